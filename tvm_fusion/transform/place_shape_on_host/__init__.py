"""PlaceShapeOnHost, as a package (the module is being split)."""

from .evaluate import PlaceShapeOnHost

__all__ = ["PlaceShapeOnHost"]
