"""This node's side of the exchange: discover the host, place local ranks on devices."""

from __future__ import annotations

import logging
import os
import socket

from topomesh.topology.build import default_placement
from topomesh.topology.model import Device, DeviceKind, Host

log = logging.getLogger("topomesh.launch")


def cpu_only_host(hostname: str | None = None) -> Host:
    """The fallback when discovery fails: one CPU device, no NICs."""
    return Host(
        hostname=hostname or socket.gethostname(),
        devices=(Device(id="CPU0", kind=DeviceKind.CPU, index=0),),
    )


def discover_local_host() -> Host:
    """Discover this host (``TOPOMESH_SYSFS_ROOT`` selects a fixture tree).

    Never raises: when discovery is unavailable or fails, logs a warning and returns
    :func:`cpu_only_host`, so a job still starts with a topology that is correct about
    which ranks share a host.
    """
    try:
        from topomesh.topology.discover import discover_host
    except ImportError as exc:
        log.warning("topomesh: host discovery is unavailable (%s); using a CPU-only description", exc)
        return cpu_only_host()
    try:
        return discover_host()
    except Exception as exc:  # discovery reads sysfs/NVML: any failure falls back
        log.warning("topomesh: host discovery failed (%s: %s); using a CPU-only description", type(exc).__name__, exc)
        return cpu_only_host()


def local_devices(host: Host, nproc: int, visible: str | None = None) -> list[str | None]:
    """The device id each local rank uses, torchrun's way: local rank ``i`` → GPU ``i``.

    ``visible`` is ``CUDA_VISIBLE_DEVICES``: a list of ordinals remaps local rank ``i`` to
    the GPU of index ``visible[i]``. CPU-only ranks get their socket's ``CPU<n>``; two
    processes on one socket are ``SHM`` apart (:func:`topomesh.topology.build.build_topology`).

    >>> from topomesh.topology.model import Device, DeviceKind, Host
    >>> h = Host(hostname="h", devices=tuple(
    ...     Device(id=f"GPU{i}", kind=DeviceKind.GPU, index=i) for i in range(4)))
    >>> local_devices(h, 2, visible="2,3")
    ['GPU2', 'GPU3']
    >>> local_devices(cpu_only_host("c"), 2)
    ['CPU0', 'CPU0']
    """
    gpus = {d.index: d.id for d in host.gpus}
    if visible and gpus:
        try:
            order = [int(v) for v in visible.split(",") if v.strip()]
        except ValueError:
            order = []  # UUIDs or MIG names: keep torchrun's plain order
        if order and all(i in gpus for i in order):
            return [gpus[order[i]] if i < len(order) else None for i in range(nproc)]
    return [r.device for r in default_placement([host], [nproc])]


def visible_devices() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")
