"""An in-process memo of `export_model`'s graphs, keyed by the model's structure (opt-in).

torch.export is most of a small model's build (~3 s of ~4 s for a tiny Qwen3.5-MoE on a 2-core
CPU). A process that builds the same architecture again (a test suite, a notebook comparing
options, a bench sweeping them) can reuse the traced graph: it depends on the module tree, the
non-tensor attributes the forward reads (configs), the parameters' and buffers' names, shapes,
dtypes and devices, and the export arguments, not on the weights' values. A hit copies the
cached graph and binds its `get_attr` nodes to the new model's own tensors (the same objects a
fresh export binds); tensors the trace itself made (`lifted_tensor_*`) come from the cache.

Opt-in with `SPECDEPLOY_EXPORT_CACHE=1` (tests/conftest.py sets it); `=check` exports anyway
and raises where a hit differs from the fresh export (run the suite so to audit the key). A
model whose structure cannot be keyed safely (a forward hook, an attribute whose repr names an
object address) is exported every time. The first build of each structure in a process always
runs torch.export.
"""
from __future__ import annotations

import hashlib
import os

import torch
from torch import fx, nn

# key -> (graph, tensors the trace made, every parameter / buffer name the fresh module held,
#         its tracer class)
_GRAPHS: dict[str, tuple] = {}
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
          "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")
_SKIP = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training",
         "_backward_pre_hooks", "_backward_hooks", "_is_full_backward_hook", "_state_dict_hooks",
         "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
         *_HOOKS}


def enabled() -> bool:
    return os.environ.get("SPECDEPLOY_EXPORT_CACHE", "") not in ("", "0")


def checking() -> bool:
    """`SPECDEPLOY_EXPORT_CACHE=check`: export anyway and compare each hit with the fresh graph."""
    return os.environ.get("SPECDEPLOY_EXPORT_CACHE", "") == "check"


def check(hit: fx.GraphModule, fresh: fx.GraphModule) -> None:
    """Raise unless `hit` is what `fresh` (the same model exported now) is: the code, every
    weight held under each name (the same tensor objects), the tensors the trace made, each
    node's meta keys."""
    problems = []
    if hit.code != fresh.code:
        problems.append("the graphs' code differs")
    for kind in ("named_parameters", "named_buffers"):
        a = dict(getattr(hit, kind)(remove_duplicate=False))
        b = dict(getattr(fresh, kind)(remove_duplicate=False))
        if a.keys() != b.keys():
            problems.append(f"{kind}: {sorted(set(a) ^ set(b))[:5]}")
        for name in a.keys() & b.keys():
            same = a[name] is b[name] or (name.split(".")[-1].startswith("lifted_tensor")
                                          and torch.equal(a[name], b[name]))
            if not same:
                problems.append(f"{name}: another tensor")
    for x, y in zip(hit.graph.nodes, fresh.graph.nodes):
        if x.meta.keys() != y.meta.keys():
            problems.append(f"node {y.name}: meta {sorted(set(x.meta) ^ set(y.meta))}")
            break
    if problems:
        raise RuntimeError("export cache: a hit differs from the fresh export: "
                           + "; ".join(problems[:8]))


def _tensor_key(t: torch.Tensor) -> str:
    return f"T{tuple(t.shape)}{t.dtype}{t.device}{t.stride()}"


def _value_key(v) -> str:
    if isinstance(v, torch.Tensor):
        return _tensor_key(v)
    name = getattr(v, "__qualname__", None)
    if callable(v) and name and "<" not in name:  # a named function or class (not a lambda)
        return f"fn:{getattr(v, '__module__', '')}.{name}"
    return repr(v)


def fingerprint(model: nn.Module, export_args: tuple) -> str | None:
    """A digest of everything the trace may read but the weights' values; None: not keyable."""
    parts: list[str] = [repr(export_args)]
    for name, mod in model.named_modules(remove_duplicate=False):
        if any(getattr(mod, h, None) for h in _HOOKS):
            return None
        cls = type(mod)
        parts.append(f"{name}:{cls.__module__}.{cls.__qualname__}:{id(cls.forward)}")
        for k, v in sorted(vars(mod).items()):
            if k in _SKIP:
                continue
            text = _value_key(v)
            if " at 0x" in text:
                return None  # an object without a value repr: its state is unknown
            parts.append(f"{k}={text}")
        for kind, table in (("p", mod._parameters), ("b", mod._buffers)):
            for k, v in table.items():
                parts.append(f"{kind}.{k}=" + ("None" if v is None else _tensor_key(v)))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def lookup(key: str | None, model: nn.Module) -> fx.GraphModule | None:
    """A copy of the cached graph bound to `model`'s tensors, or None."""
    if key is None or key not in _GRAPHS:
        return None
    graph, made, held, tracer_cls = _GRAPHS[key]
    copy = _copy(graph)
    root: dict[str, object] = {}
    for node in copy.nodes:
        if node.op == "get_attr":
            root[node.target] = (made[node.target].clone() if node.target in made
                                 else _resolve(model, node.target))
    gm = fx.GraphModule(root, copy)
    # NOTE: a fresh export's module also holds weights its graph does not read (a VLM target's
    # embedding, read outside the graph); transforms look some of them up by name
    for name, is_param in held:
        if _resolve(gm, name, None) is None:
            _assign(gm, name, _resolve(model, name), is_param)
    gm._tracer_cls = tracer_cls
    gm.recompile()
    return gm


def store(key: str | None, gm: fx.GraphModule, model: nn.Module) -> None:
    """Keep `gm`'s graph (a copy: transforms rewrite theirs) and the tensors its trace made."""
    if key is None:
        return
    graph = _copy(gm.graph)
    made = {}
    for node in graph.nodes:
        if node.op == "get_attr" and _resolve(model, node.target, None) is None:
            made[node.target] = _resolve(gm, node.target).detach().clone()
    held = [(n, True) for n, _ in gm.named_parameters(remove_duplicate=False)]
    held += [(n, False) for n, _ in gm.named_buffers(remove_duplicate=False)]
    if any(n not in made and _resolve(model, n, None) is None for n, _ in held):
        return  # a weight the model does not hold under that name: not reproducible by name
    _GRAPHS[key] = (graph, made, held, getattr(gm, "_tracer_cls", None))


def _copy(graph: fx.Graph) -> fx.Graph:
    """Nodes, their meta (shallow: transforms replace entries, never edit them) and the output."""
    out = fx.Graph()
    value, old = out.graph_copy(graph, {}, return_output_node=True)
    out.output(value, type_expr=old.type).meta = dict(old.meta)
    return out


def _assign(root: nn.Module, target: str, value: torch.Tensor, is_param: bool) -> None:
    *path, field = target.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if is_param:
        mod.register_parameter(field, value)
    else:
        mod.register_buffer(field, value)


def _resolve(root: nn.Module, target: str, default=...):
    obj = root
    for part in target.split("."):
        if not hasattr(obj, part):
            if default is ...:
                raise AttributeError(f"export cache: {target!r} is not on the model")
            return default
        obj = getattr(obj, part)
    return obj
