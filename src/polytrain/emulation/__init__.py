"""Emulated devices for every strategy: device types and clusters, layer profiles, device clocks.

A worker on an emulated device runs each layer for real, then waits out the
time its device would take (``emulate``); the partitioners and planners read
the same profiles. Nothing here knows any strategy.
"""

from .clock import DeviceClock, clock_of, emulate
from .devices import BUILTIN_TYPES, Cluster, Device, DeviceType, homogeneous, parse_cluster
from .profile import LayerProfile, ModelProfile, layers_of, profile_model

__all__ = ["DeviceClock", "clock_of", "emulate", "BUILTIN_TYPES", "Cluster", "Device",
           "DeviceType", "homogeneous", "parse_cluster", "LayerProfile", "ModelProfile",
           "layers_of", "profile_model"]
