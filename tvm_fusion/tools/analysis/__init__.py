"""What a compiled (or partly compiled) module does (see ``report``)."""

from .report import *  # noqa: F403
