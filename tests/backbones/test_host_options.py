"""The shared host-option resolver (``backbones/options.py``), mixer re-initialisation, and the tools' layering."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

import pytest
import torch
from pydantic import Field
from torch import Tensor, nn

import mixer_plugins as mp
from mixer_plugins.backbones.options import HostModel, direction_problem, head_dim_for, host_options, resolve_config
from mixer_plugins.backbones.reinit import reinitialize_mixer

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "mixer_plugins"


class _HeadsConfig(mp.MixerConfig):
    num_heads: int = Field(8, gt=0)
    causal: bool = Field(False)
    max_seq_len: Optional[int] = Field(None, gt=0)
    dropout: float = Field(0.1, ge=0)


class _HeadWidthConfig(mp.MixerConfig):
    expand: int = Field(2, gt=0)
    head_dim: int = Field(64, gt=0)


class _PlainConfig(mp.MixerConfig):
    pass


def _spec(name: str, config: type[mp.MixerConfig], direction: str = "bidirectional") -> mp.MixerSpec:
    return mp.MixerSpec(name=name, config=config, builder=lambda c: nn.Identity(), direction=direction)


HEADS = _spec("heads_test", _HeadsConfig, "either")
HEAD_WIDTH = _spec("head_width_test", _HeadWidthConfig)
CAUSAL_ONLY = _spec("causal_only_test", _PlainConfig, "causal")


def test_host_facts_fill_matching_fields_and_the_user_wins():
    host = HostModel(dim=64, num_heads=4, max_seq_len=16, attn_drop=0.2)
    resolved = host_options(HEADS, host, {"num_heads": 2})
    assert resolved.options == {"num_heads": 2, "max_seq_len": 16, "dropout": 0.2}
    assert dict(resolved.from_host) == {"max_seq_len": 16, "dropout": 0.2}
    # A mixer without such fields gets nothing from the host (its own defaults).
    with pytest.warns(UserWarning, match="asks for attn_drop=0.2"):
        assert host_options(HEAD_WIDTH, host).options == {}


def test_switch_facts_only_when_on_and_warned_when_the_mixer_cannot():
    assert "dropout" not in host_options(HEADS, HostModel(dim=64, attn_drop=0.0)).options  # keeps its 0.1
    with pytest.warns(UserWarning, match="asks for qk_norm=True, but mixer 'heads_test' has no such option"):
        host_options(HEADS, HostModel(dim=64, qk_norm=True, source="the test model"))


def test_head_width_is_derived_only_when_asked():
    host = HostModel(dim=64, num_heads=4)
    assert host_options(HEAD_WIDTH, host).options == {}
    assert host_options(HEAD_WIDTH, host, derive_head_dim=True).options == {"head_dim": 2 * 64 // 4}
    assert host_options(HEAD_WIDTH, host, {"expand": 1}, derive_head_dim=True).options == {"expand": 1, "head_dim": 16}
    assert head_dim_for(HEAD_WIDTH, 64, 3) is None  # 128 is not a multiple of 3
    assert head_dim_for(HEADS, 64, 4) is None  # it has num_heads itself


def test_required_direction_and_preferred_direction():
    assert host_options(HEADS, HostModel(dim=8, causal=True)).options == {"causal": True}
    assert host_options(HEADS, HostModel(dim=8, prefer_causal=False)).options == {"causal": False}
    assert host_options(CAUSAL_ONLY, HostModel(dim=8, prefer_causal=False)).options == {}  # merely preferred
    assert direction_problem(CAUSAL_ONLY, False) == ("mixer 'causal_only_test' is causal only; it has no "
                                                     "bidirectional form")
    assert direction_problem(CAUSAL_ONLY, True) is None and direction_problem(HEADS, True) is None
    with pytest.raises(mp.MixerError, match="causal only"):
        host_options(CAUSAL_ONLY, HostModel(dim=8, causal=False))


def test_errors_name_what_came_from_the_host():
    with pytest.raises(mp.InvalidMixerOptions, match="dim is set by the test model"):
        host_options(HEADS, HostModel(dim=8, source="the test model"), {"dim": 4})
    host = HostModel(dim=8, num_heads=0, source="the test model", override_hint="say otherwise")
    with pytest.raises(mp.InvalidMixerOptions, match=r"note: num_heads=0 came from the test model; say otherwise"):
        resolve_config(HEADS, host)
    config, from_host = resolve_config(HEADS, HostModel(dim=8, num_heads=2))
    assert (config.dim, config.num_heads, dict(from_host)) == (8, 2, {"num_heads": 2})


class _Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(3))
        self.resets = 0

    def reset_parameters(self) -> None:
        self.resets += 1
        nn.init.constant_(self.weight, 7.0)


def test_reinitialize_uses_reset_parameters_and_otherwise_rebuilds():
    counted = _Counted()
    reinitialize_mixer(counted, rebuild=lambda: pytest.fail("rebuilt a mixer that has reset_parameters"))
    assert counted.resets == 1 and (counted.weight == 7).all()
    plain, fresh = nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2))  # no reset_parameters itself
    reinitialize_mixer(plain, rebuild=lambda: fresh)
    assert torch.equal(plain[0].weight, fresh[0].weight) and torch.equal(plain[0].bias, fresh[0].bias)
    on_meta = _Counted().to("meta")
    reinitialize_mixer(on_meta, rebuild=lambda: pytest.fail("rebuilt on meta"))
    assert on_meta.resets == 0


class _ResetConfig(mp.MixerConfig):
    num_heads: int = Field(2, gt=0)


class _ResetMixer(nn.Module):
    causal: bool = False
    resets = 0
    built = 0

    def __init__(self, config: _ResetConfig):
        super().__init__()
        type(self).built += 1
        self.config = config
        self.value = nn.Linear(config.dim, config.dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        type(self).resets += 1
        nn.init.constant_(self.value.weight, 0.5)
        nn.init.zeros_(self.value.bias)

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        return self.value(x)


def test_timm_adapter_reinitialises_through_reset_parameters():
    timm = pytest.importorskip("timm")
    from mixer_plugins.backbones.timm import TimmMixerAttention, register_attn_layers

    spec = mp.MixerSpec(name="reset_test_mixer", config=_ResetConfig, builder=_ResetMixer)
    mp.register_mixer(spec)
    try:
        adapter = TimmMixerAttention(16, num_heads=2, mixer="reset_test_mixer")
        nn.init.constant_(adapter.mixer.value.weight, -1.0)
        resets, built = _ResetMixer.resets, _ResetMixer.built
        adapter.init_weights()
        assert (_ResetMixer.resets, _ResetMixer.built) == (resets + 1, built)  # reset in place, nothing rebuilt
        assert (adapter.mixer.value.weight == 0.5).all()
        # timm's own ViT: its init pass re-draws every nn.Linear, then init_weights() restores the mixer's init.
        register_attn_layers(["reset_test_mixer"])
        for weight_init in ("", "jax"):
            model = timm.create_model("vit_tiny_patch16_224", attn_layer="reset_test_mixer", img_size=16,
                                      patch_size=8, embed_dim=16, depth=2, num_heads=2, weight_init=weight_init)
            for block in model.blocks:
                assert (block.attn.mixer.value.weight == 0.5).all() and (block.attn.mixer.value.bias == 0).all()
    finally:
        mp.unregister_mixer("reset_test_mixer")


# -- layering ------------------------------------------------------------------------------------------------

def _imports(path: Path) -> list[str]:
    """Every module a file imports (anywhere in it), relative ones resolved against its package."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append(module)
            found.extend(f"{module}.{alias.name}" for alias in node.names)
    return found


def test_backbone_options_import_no_host_library():
    for name in ("__init__.py", "options.py", "reinit.py"):
        bad = [m for m in _imports(PACKAGE / "backbones" / name) if m.split(".")[0] in ("timm", "fairseq2")
               or ".backbones.timm" in m or ".backbones.fairseq2" in m]
        assert not bad, f"backbones/{name} imports {bad}"


def test_model_code_never_imports_the_tools():
    offenders = []
    for folder in ("kernels", "layers", "registry", "mixers", "testing", "backbones"):
        for path in (PACKAGE / folder).rglob("*.py"):
            offenders += [f"{path.relative_to(REPO)}: {m}" for m in _imports(path)
                          if m.startswith("mixer_plugins.tools") or m.startswith("mixer_plugins.cli")]
    assert not offenders, offenders


def test_tools_modules_do_not_import_the_cli():
    """The cycles cli <-> demo and cli <-> tables are gone: only the cli imports the other tools."""
    for path in (PACKAGE / "tools").glob("*.py"):
        bad = [m for m in _imports(path) if m.startswith("mixer_plugins.tools.cli")]
        assert not bad, f"{path.relative_to(REPO)} imports {bad}"
