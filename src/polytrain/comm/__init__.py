"""Communication core: topology, traffic meter, point-to-point transport, partitions, buckets."""

from .bucket import Bucket, flatten, plan_buckets, unflatten_into
from .meter import MachineTraffic, MeterReport, TrafficMeter, machine_traffic, server_traffic
from .p2p import Handle, Transport
from .partition import Partition, TensorSpec, partition
from .topology import Peer, Topology

__all__ = ["Topology", "Peer", "TrafficMeter", "MeterReport", "MachineTraffic",
           "machine_traffic", "server_traffic", "Transport", "Handle", "TensorSpec", "Partition",
           "partition",
           "Bucket", "plan_buckets", "flatten", "unflatten_into"]
