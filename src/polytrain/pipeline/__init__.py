"""Pipelines on heterogeneous devices: clusters, emulation, profiles, partitioner, allocation,
schedules, the stage engine (synchronous and HetPipe's asynchronous pipelines) and WSP."""

from .allocation import POLICIES, HetPipePlan, VirtualWorker, allocate, plan_hetpipe
from .asyncpipe import AsyncPipeline
from .devices import BUILTIN_TYPES, Cluster, Device, DeviceType, parse_cluster
from .emulation import DeviceClock, clock_of, emulate
from .partition import PipelinePlan, plan_pipeline
from .profile import LayerProfile, ModelProfile, profile_model
from .schedule import asynchronous, gpipe, one_f_one_b
from .stage import Stage, StageSpec
from .sync import SyncPipeline
from .wsp import WaveSync

__all__ = ["Cluster", "Device", "DeviceType", "BUILTIN_TYPES", "parse_cluster", "DeviceClock",
           "emulate", "clock_of", "LayerProfile", "ModelProfile", "profile_model",
           "PipelinePlan", "plan_pipeline", "POLICIES", "VirtualWorker", "HetPipePlan",
           "allocate", "plan_hetpipe", "gpipe", "one_f_one_b", "asynchronous", "Stage",
           "StageSpec", "SyncPipeline", "AsyncPipeline", "WaveSync"]
