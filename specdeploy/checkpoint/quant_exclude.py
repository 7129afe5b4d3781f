"""Checkpoint exclusion globs (`exclude_modules` / `modules_to_not_convert`) → deployment names.

A checkpoint's globs name *its* modules (`model.language_model.layers.0.mlp.gate`, `backbone.X`,
`mtp.layers.0.*`); a deployment has two namespaces (DESIGN.md invariant 6): the target's own
names (`model.layers.0.mlp.gate`, `lm_head`) and the drafter's, `eagle_drafter.*`. Mapping, as
TensorRT-LLM AutoDeploy does (EagleOneModelFactory.get_quant_config), with its bug designed out:
- the target's export prefix is replaced by ours (`model.language_model.X`, `backbone.X` →
  `model.X`);
- globs naming MTP modules (`mtp*`, `mtp.layers.0*`; DeepSeek-style `model.layers.{L}*` with
  L >= num_hidden_layers) are moved under `eagle_drafter` (AutoDeploy's drafter root was `model`,
  so `mtp.layers.0*` became `model.layers*` and excluded the whole target);
- a rooted glob naming MTP modules that the checkpoint does not have (`mtp*` in a DeepSeek-style
  checkpoint, whose MTP layers are `model.layers.{L}.*`) names nothing and is dropped: our own
  quantizer once wrote it beside a quantized MTP layer, and mapping it to `eagle_drafter*`
  would exclude what the checkpoint quantized;
- globs starting with a wildcard (`*.mlp.gate`, `*mixer.gate*`) name a *kind* of module and apply
  in both namespaces; a rooted glob matching modules of both namespaces (`m*`) is refused, and so
  is any glob that would exclude every quantizable module of the target.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from fnmatch import fnmatchcase

from specdeploy.checkpoint.reader import CheckpointError

__all__ = ["DRAFTER_ROOT", "ExclusionMap", "is_drafter_module", "map_exclusions",
           "target_module_name"]

DRAFTER_ROOT = "eagle_drafter"
# checkpoint export prefix → the target's own (all our families root the decoder at `model.`)
_TARGET_PREFIXES = (("language_model.model.language_model.", "model."),
                    ("model.language_model.", "model."), ("language_model.backbone.", "model."),
                    ("language_model.model.", "model."), ("backbone.", "model."),
                    ("language_model.lm_head", "lm_head"), ("model.", "model."))
_LAYER = re.compile(r"^(?:model\.language_model\.|model\.|backbone\.)layers\.(\d+)(?=[.*?\[]|$)")


@dataclass(frozen=True)
class ExclusionMap:
    """Mapped globs: `target` over the target's names, `drafter` over `eagle_drafter.*`, and
    `anywhere` (wildcard-led) over both. `why(name)` gives the checkpoint glob excluding it."""

    target: tuple[tuple[str, str], ...]  # (mapped glob, checkpoint glob)
    drafter: tuple[tuple[str, str], ...]
    anywhere: tuple[str, ...]

    def why(self, name: str) -> str | None:
        """The checkpoint glob that excludes deployment module `name`, or None."""
        drafter = name == DRAFTER_ROOT or name.startswith(DRAFTER_ROOT + ".")
        for mapped, orig in self.drafter if drafter else self.target:
            if fnmatchcase(name, mapped):
                return f"{orig!r} -> {mapped!r}" if mapped != orig else repr(orig)
        for g in self.anywhere:
            if fnmatchcase(name, g):
                return repr(g)
        return None


def target_module_name(ckpt_name: str) -> str:
    """A checkpoint module name of the target → ours (`backbone.layers.3.mixer` →
    `model.layers.3.mixer`)."""
    for theirs, ours in _TARGET_PREFIXES:
        if ckpt_name.startswith(theirs):
            return ours + ckpt_name[len(theirs):]
    return ckpt_name


def is_drafter_module(name: str, n_layers: int) -> bool:
    """Whether checkpoint module `name` belongs to an MTP drafter (`mtp.*`, or DeepSeek-style
    decoder layer L >= n_layers)."""
    if name == "mtp" or name.startswith("mtp."):
        return True
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) >= n_layers


def _map_rooted(glob: str, n_layers: int) -> tuple[str, bool]:
    """(mapped glob, is_drafter) for a glob with a literal root."""
    if glob.startswith("mtp"):
        return DRAFTER_ROOT + glob[3:], True
    m = _LAYER.match(glob)
    if m is not None and int(m.group(1)) >= n_layers:  # DeepSeek-style MTP layer L, L+1, ...
        return f"{DRAFTER_ROOT}.layers.{int(m.group(1)) - n_layers}{glob[m.end():]}", True
    for theirs, ours in _TARGET_PREFIXES:
        if glob.startswith(theirs):
            return ours + glob[len(theirs):], False
    return glob, False


def map_exclusions(globs: tuple[str, ...] | list[str], ckpt_modules: list[str], n_layers: int,
                   target_modules: list[str] = ()) -> ExclusionMap:
    """Map checkpoint globs into the deployment's namespaces (see the module docstring).

    `ckpt_modules`: the checkpoint's module names (tensor names minus the leaf); `n_layers`: the
    target's num_hidden_layers; `target_modules`: our names of the target's quantizable modules
    (a glob excluding all of them is refused)."""
    ckpt_t = [m for m in ckpt_modules if not is_drafter_module(m, n_layers)]
    ckpt_d = [m for m in ckpt_modules if is_drafter_module(m, n_layers)]
    target, drafter, anywhere = [], [], []
    for g in globs:
        if g[:1] in ("*", "?", "["):
            anywhere.append(g)
            mapped_t = g
        else:
            in_t = [m for m in ckpt_t if fnmatchcase(m, g)]
            in_d = [m for m in ckpt_d if fnmatchcase(m, g)]
            if in_t and in_d:
                raise CheckpointError(
                    f"exclusion glob {g!r} matches modules of both the target ({in_t[0]!r}, ...) "
                    f"and its MTP drafter ({in_d[0]!r}, ...); the namespaces must stay disjoint")
            mapped, is_drafter = _map_rooted(g, n_layers)
            if in_d and not is_drafter:
                raise CheckpointError(f"exclusion glob {g!r} names MTP modules ({in_d[0]!r}) "
                                      f"but does not start with 'mtp': cannot map it into "
                                      f"{DRAFTER_ROOT}.*")
            if is_drafter:
                if in_d:  # (one matching nothing here excludes nothing: module docstring)
                    drafter.append((mapped, g))
                continue
            target.append((mapped, g))
            mapped_t = mapped
        if target_modules and all(fnmatchcase(m, mapped_t) for m in target_modules):
            raise CheckpointError(f"exclusion glob {g!r} excludes every quantizable module of "
                                  f"the target ({len(target_modules)} modules): refusing a "
                                  f"'quantized' checkpoint with nothing quantized")
    return ExclusionMap(tuple(target), tuple(drafter), tuple(anywhere))
