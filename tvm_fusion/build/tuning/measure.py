"""Building and measuring candidates: the build function of MetaSchedule's builder, and the
RPC tracker that a remote runner measures through.

:func:`build_candidate` is MetaSchedule's ``default_build`` without its 32 s import of every
tensor intrinsic (and, on GPUs, with global symbols and ``cp.async`` as the pipeline builds);
:func:`parse_tracker` and :func:`check_tracker` refuse a bad ``HOST:PORT`` or a tracker that
does not answer in one line, before MetaSchedule's runner would retry it for minutes;
:class:`PooledBuilder` builds every batch of a tuning run on one pool of processes.
"""

from __future__ import annotations

import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.builder import BuilderResult, PyBuilder
from tvm.s_tir.meta_schedule.builder.local_builder import _serialize_params, _worker_func
from tvm.s_tir.meta_schedule.utils import cpu_count
from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

from ...errors import UsageError
from ...target import async_copy, is_cpu


def parse_tracker(spec: str) -> tuple[str, int]:
    host, sep, port = spec.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UsageError(f"RPC tracker must be HOST:PORT, got {spec!r}")
    return host, int(port)


def check_tracker(host: str, port: int, timeout_s: float = 5.0) -> None:
    """Raise a UsageError unless an RPC tracker answers at ``host:port`` within ``timeout_s``
    (its handshake: the tracker echoes its magic number). MetaSchedule's RPC runner retries a
    refused connection every 5 s for a minute, in each of its workers, and waits without end
    on a port where something else listens."""
    import socket
    import struct

    from tvm.rpc import base

    where = f"{host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(struct.pack("<i", base.RPC_TRACKER_MAGIC))
            reply = sock.recv(4)
    except TimeoutError:
        raise UsageError(f"RPC tracker {where} did not answer within {timeout_s:g} s") from None
    except OSError as err:
        raise UsageError(f"cannot reach RPC tracker {where}: {err.strerror or err}") from None
    if len(reply) != 4 or struct.unpack("<i", reply)[0] != base.RPC_TRACKER_MAGIC:
        raise UsageError(f"{where} is not a TVM RPC tracker (it did not answer its handshake)")


def build_candidate(mod: tvm.IRModule, target, _params=None):
    """MetaSchedule's ``default_build`` minus ``import tvm.s_tir.tensor_intrin``.

    The stock build function imports every tensor intrinsic (CUDA, ROCm, ...) first: 32 s on
    this 2-core machine, paid again by each builder process of each batch, so with the default
    30 s build timeout the first candidates of every batch time out. A candidate arrives
    scheduled, its tensorized blocks already replaced by the intrinsics' bodies, so the build
    needs none of them registered (on GPUs either).

    On GPUs: every PrimFunc gets a global symbol (TVM 0.27's CUDA codegen fails on a kernel of
    one without: "Type tirx.BufferType does not have a corresponding C Type"), and the build
    runs as the pipeline's does (``engine.compile_module``: ``cp.async`` on sm_80+).
    """
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    if is_cpu(target):
        return tvm_build(mod, target=target)
    mod = tvm.IRModule(
        {
            gv: f.with_attr("global_symbol", gv.name_hint)
            if isinstance(f, tvm.tirx.PrimFunc) and "global_symbol" not in (f.attrs or {})
            else f
            for gv, f in mod.functions_items()
        }
    )
    config = {"tirx.use_async_copy": True} if async_copy(target) else {}
    with tvm.transform.PassContext(opt_level=3, config=config), target:
        return tvm_build(mod, target=target)


@derived_object
class PooledBuilder(PyBuilder):
    """MetaSchedule's ``LocalBuilder`` on one pool of build processes kept across batches.

    ``LocalBuilder`` starts a fresh pool for each batch (and one more in its constructor, for
    a check that a worker finds the build function): each start imports TVM in every worker,
    about 5 s on a 2-core machine, paid by every batch of a search, by the seeded defaults and
    by the finalists. Here the pool starts at the first batch and stays until :meth:`close`;
    each worker is replaced after ``uses`` candidates (TVM's reason for its fresh pools is a
    memory leak of long-used workers) and after a timeout (the pool kills it and starts
    another at its next candidate). A worker that cannot find the build function reports it
    per candidate, as the constructor's check would have.
    """

    def __init__(self, *, timeout_sec: float, f_build, max_workers: int | None = None,
                 uses: int = 256) -> None:  # fmt: skip
        super().__init__()
        self.timeout_sec = timeout_sec
        self.f_build = f_build
        self.max_workers = max_workers or cpu_count(logical=True)
        self.uses = uses
        self._pool = None

    def build(self, build_inputs):
        if self._pool is None:
            self._pool = PopenPoolExecutor(
                max_workers=self.max_workers,
                timeout=self.timeout_sec,
                maximum_process_uses=self.uses,
            )
        args = [
            (self.f_build, None, b.mod, b.target, _serialize_params(b.params)) for b in build_inputs
        ]
        results = []
        for done in self._pool.map_with_error_catching(lambda x: _worker_func(*x), args):
            if done.status == StatusKind.COMPLETE:
                results.append(BuilderResult(done.value, None))
            elif done.status == StatusKind.TIMEOUT:
                why = f"PooledBuilder: Timeout, killed after {self.timeout_sec} seconds"
                results.append(BuilderResult(None, why))
            else:
                why = "PooledBuilder: An exception occurred\n" + str(done.value)
                results.append(BuilderResult(None, why))
        return results

    def close(self) -> None:
        """End the build processes (a later :meth:`build` starts new ones)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
