"""How many bytes a compiled collective puts on the network, per device.

Collectives are what ``collectives.find_collectives`` lists; this module sizes their device
groups and turns result bytes into ring-algorithm traffic.
"""

from __future__ import annotations

import math
import re

from shardax.analysis.collectives import REDUCE_SCATTER_PATTERN, Collective

# mesh['a'=2,'b'=4] {'b'}, possibly with ", device_ids=([2,4]T(1,0))" before the used axes
_MESH_GROUPS = re.compile(r"mesh\[(?P<axes>[^\]]*)\](?:,\s*device_ids=\S+)?\s*(\{(?P<used>[^}]*)\})?")
_IOTA_GROUPS = re.compile(r"^\[(?P<groups>\d+),(?P<size>\d+)\]")


def group_size(replica_groups: str, num_devices: int) -> int:
    """How many devices take part in each group of a collective, from its groups attribute.

    Reads the explicit form ``{{0,1,2,3},{4,5,6,7}}``, the iota form ``[2,4]<=[8]`` and the
    mesh form ``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`` (with or without ``device_ids=...``
    before the braces); anything else means every device.
    """
    text = replica_groups.strip()
    if text.startswith("{{"):
        first = text[2:].split("}", 1)[0]
        return len([part for part in first.split(",") if part.strip()]) or num_devices
    iota = _IOTA_GROUPS.match(text)
    if iota:
        return int(iota["size"])
    mesh = _MESH_GROUPS.search(text)
    if mesh:
        sizes = dict(re.findall(r"'?([\w]+)'?=(\d+)", mesh["axes"]))
        used = re.findall(r"'?(\w+)'?", mesh["used"] or "") or list(sizes)
        return math.prod(int(sizes[name]) for name in used if name in sizes) or num_devices
    return num_devices


def wire_bytes(collective: Collective, num_devices: int) -> float:
    """Bytes one device sends per execution with ring algorithms (what a fast network would carry).

    all-reduce of S over n devices: 2(n-1)/n S; all-gather to S, reduce-scatter from S
    (including the CPU all-reduce + dynamic-slice form, counted as the reduce-scatter a GPU
    would run) and all-to-all: (n-1)/n S; collective-permute: S times the share of devices
    that send to another device (its source-target pairs over all devices: a pipeline's shift
    split into two permutes sends S from each device once, not twice; a pair whose source is
    its target, as XLA writes into a regrouping permute, sends nothing).
    """
    if collective.kind == "collective-permute":
        pairs = re.findall(r"\{(\d+),(\d+)\}", collective.replica_groups)
        crossing = [pair for pair in pairs if pair[0] != pair[1]]
        share = min(len(crossing) / num_devices, 1.0) if pairs else 1.0
        return share * collective.bytes
    if collective.kind == REDUCE_SCATTER_PATTERN:
        n = max(round(collective.bytes / max(collective.shard_bytes, 1)), 1)
        return (n - 1) / n * collective.bytes
    if collective.kind == "all-gather" and collective.operand_bytes:
        n = max(round(collective.bytes / collective.operand_bytes), 1)
    elif collective.kind == "reduce-scatter" and collective.operand_bytes:
        n = max(round(collective.operand_bytes / max(collective.bytes, 1)), 1)
    else:
        n = group_size(collective.replica_groups, num_devices)
    if n <= 1:
        return 0.0
    share = (n - 1) / n
    if collective.kind == "all-reduce":
        return 2 * share * collective.bytes
    if collective.kind == "reduce-scatter":
        return share * collective.bytes * n  # the result is one shard of the reduced input
    return share * collective.bytes
