"""Minimisation of a failing ONNX case: :func:`minimise` drops graph outputs and bypasses nodes,
then cuts the feeds' dynamic dims, while the case keeps failing the same way (every candidate
checked by ``onnx.checker`` and run by ONNX Runtime first).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from .onnx_run import ort_outputs


def _dead_code(model) -> None:
    graph = model.graph
    live = {o.name for o in graph.output}
    keep = []
    for node in reversed(list(graph.node)):
        if any(o in live for o in node.output):
            keep.append(node)
            live.update(i for i in node.input if i)
    del graph.node[:]
    graph.node.extend(reversed(keep))
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    inits = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(inits)
    inputs = [v for v in graph.input if v.name in used]
    del graph.input[:]
    graph.input.extend(inputs)


def _shapes(model) -> dict[str, tuple]:
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)
    out = {}
    for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        t = v.type.tensor_type
        if not t.HasField("shape"):
            continue
        dims = tuple(
            d.dim_value if d.HasField("dim_value") else d.dim_param or "?" for d in t.shape.dim
        )
        out[v.name] = (t.elem_type, dims)
    for t in model.graph.initializer:
        out[t.name] = (t.data_type, tuple(t.dims))
    return out


def _candidates(model):
    """Smaller models: one graph output dropped, or one node bypassed (its output replaced by
    one of its inputs of the same type and shape)."""
    import copy

    graph = model.graph
    if len(graph.output) > 1:
        for i in range(len(graph.output)):
            m = copy.deepcopy(model)
            del m.graph.output[i]
            _dead_code(m)
            yield m
    shapes = _shapes(model)
    for idx in reversed(range(len(graph.node))):
        node = graph.node[idx]
        if len(node.output) != 1 or node.output[0] not in shapes:
            continue
        for src in node.input:
            if src and shapes.get(src) == shapes[node.output[0]] and "?" not in str(shapes[src]):
                m = copy.deepcopy(model)
                old = m.graph.node[idx].output[0]
                del m.graph.node[idx]
                for n in m.graph.node:
                    for j, name in enumerate(n.input):
                        if name == old:
                            n.input[j] = src
                for o in m.graph.output:
                    if o.name == old:
                        o.name = src
                if len({o.name for o in m.graph.output}) != len(m.graph.output) or any(
                    o.name in {i.name for i in m.graph.input} for o in m.graph.output
                ):
                    continue
                _dead_code(m)
                yield m
                break


def _valid(model, feeds) -> bool:
    import onnx

    try:
        onnx.checker.check_model(model, full_check=True)
        for f in feeds:
            ort_outputs(
                model, {k: v for k, v in f.items() if k in {i.name for i in model.graph.input}}
            )
    except Exception:
        return False
    return True


def _smaller_feeds(model, feeds):
    """Feeds with one dynamic dim of one feed cut down (to 1, 2 or half), every input that
    names the dim sliced alike."""
    axes: dict[str, list[tuple[str, int]]] = {}
    for v in model.graph.input:
        for ax, d in enumerate(v.type.tensor_type.shape.dim):
            if d.dim_param:
                axes.setdefault(d.dim_param, []).append((v.name, ax))
    for where in axes.values():
        for i, feed in enumerate(feeds):
            size = feed[where[0][0]].shape[where[0][1]]
            for new in sorted({1, 2, size // 2} - {0}):
                if new >= size:
                    continue
                cut = dict(feed)
                for name, ax in where:
                    cut[name] = np.take(feed[name], np.arange(new), axis=ax)
                yield feeds[:i] + [cut] + feeds[i + 1 :]


def minimise(
    model, feeds, outcome: str, run: Callable, budget_s: float = 120.0
) -> tuple[object, list[dict], str]:
    """Greedily drop outputs and nodes, then shrink the dynamic dims of the feeds, while
    ``run(model, feeds)`` keeps giving ``outcome`` (within ``budget_s``); returns the smallest
    (model, feeds, reason) found."""
    deadline = time.monotonic() + budget_s
    best, reason = model, ""
    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        for cand in _candidates(best):
            if time.monotonic() > deadline:
                break
            names = {i.name for i in cand.graph.input}
            cfeeds = [{k: v for k, v in f.items() if k in names} for f in feeds]
            if len(cand.graph.node) >= len(best.graph.node) and len(cand.graph.output) >= len(
                best.graph.output
            ):
                continue
            if not _valid(cand, cfeeds):
                continue
            got, why = run(cand, cfeeds)
            if got == outcome:
                best, feeds, reason, improved = cand, cfeeds, why, True
                break
    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        for cfeeds in _smaller_feeds(best, feeds):
            if time.monotonic() > deadline:
                break
            if not _valid(best, cfeeds):
                continue
            got, why = run(best, cfeeds)
            if got == outcome:
                feeds, reason, improved = cfeeds, why, True
                break
    return best, feeds, reason
