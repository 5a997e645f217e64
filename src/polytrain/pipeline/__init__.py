"""Pipelines: the partitioner, stage assembly, schedules, the stage engine (synchronous and
HetPipe's asynchronous pipelines), HetPipe's allocation, weight prediction and WSP;
PipeTransformer's freeze rule, re-plan and activation cache.

Device emulation and layer profiles, which every strategy uses, live in
:mod:`polytrain.emulation`.
"""

from .allocation import POLICIES, HetPipePlan, VirtualWorker, allocate, plan_hetpipe
from .assembly import fused_keys, make_stage, stage_optimizer
from .asyncpipe import AsyncPipeline
from .autopipe import PipePlan, plan_pipe
from .cache import ActivationCache, frozen_forward
from .freeze import GradNormTracker, freeze_cap, next_frozen
from .partition import PipelinePlan, plan_pipeline
from .schedule import asynchronous, gpipe, one_f_one_b
from .stage import Stage, StageSpec
from .sync import SyncPipeline
from .wsp import WaveSync

__all__ = ["PipelinePlan", "plan_pipeline", "POLICIES", "VirtualWorker", "HetPipePlan",
           "allocate", "plan_hetpipe", "gpipe", "one_f_one_b", "asynchronous", "Stage",
           "StageSpec", "SyncPipeline", "AsyncPipeline", "WaveSync", "make_stage",
           "stage_optimizer", "fused_keys", "PipePlan", "plan_pipe", "ActivationCache",
           "frozen_forward", "GradNormTracker", "freeze_cap", "next_frozen"]
