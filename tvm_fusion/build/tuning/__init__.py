"""MetaSchedule tuning runs over the fused groups, and applying their database (see ``run``)."""

from .run import *  # noqa: F403
from .run import _time_here  # noqa: F401
