"""The registry: entry-point discovery, laziness, aliases, errors, broken and duplicate plugins."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
from helpers import make_fake_distribution
from pydantic import Field, ValidationError

import mixer_plugins as mp
from mixer_plugins.registry import MixerRegistry

SPEC_MODULE = """
from pydantic import Field, ValidationError
from mixer_plugins import MixerConfig, MixerSpec
from mixer_plugins.mixers.attention import SoftmaxAttention, AttentionConfig

class Cfg(AttentionConfig):
    pass

SPEC = MixerSpec(name="{name}", config=Cfg, builder=SoftmaxAttention, summary="fake {name}",
                 aliases={aliases!r})
"""


def spec_module(name: str, aliases: tuple[str, ...] = ()) -> str:
    return SPEC_MODULE.format(name=name, aliases=aliases)


def test_builtin_attention_is_discovered_through_entry_points():
    from importlib.metadata import entry_points

    eps = {ep.name: ep for ep in entry_points(group=mp.ENTRY_POINT_GROUP)}
    assert eps["attention"].value == "mixer_plugins.mixers.attention:SPEC"
    assert "attention" in mp.list_mixers()
    assert mp.get_spec("attention").distribution == "mixer-plugins"


def test_example_plugin_is_listed_created_and_conforms():
    assert "ema" in mp.list_mixers()
    spec = mp.get_spec("ema")
    assert spec.distribution == "mixer-plugins-example"
    mixer = mp.create_mixer("moving_average", dim=16, num_heads=2)
    assert type(mixer).__name__ == "EMAMixer"
    from mixer_plugins.testing import check_mixer

    assert all(r.passed for r in check_mixer("ema"))


def test_listing_names_imports_no_plugin_code():
    code = (
        "import sys, mixer_plugins as mp; names = mp.list_mixers(); "
        "assert 'attention' in names and 'ema' in names, names; "
        "loaded = [m for m in ('mixer_plugins.mixers.attention', 'mixer_plugins_example') if m in sys.modules]; "
        "assert not loaded, loaded; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_aliases_and_name_normalisation():
    assert mp.get_spec("mha").name == "attention"
    assert mp.get_spec("Softmax-Attention").name == "attention"
    assert mp.get_spec(" ATTENTION ").name == "attention"


def test_misspelt_name_suggests_the_right_one():
    with pytest.raises(mp.UnknownMixerError) as info:
        mp.create_mixer("attentoin", dim=64)
    assert "did you mean 'attention'" in str(info.value)
    assert "attention" in info.value.suggestions


def test_unknown_name_without_close_match_lists_known_names():
    with pytest.raises(mp.UnknownMixerError) as info:
        mp.create_mixer("zzzzzz", dim=64)
    assert "did you mean" not in str(info.value)
    assert "attention" in str(info.value)


def test_indivisible_heads_say_why():
    with pytest.raises(mp.InvalidMixerOptions) as info:
        mp.create_mixer("attention", dim=64, num_heads=5)
    message = str(info.value)
    assert "64" in message and "5" in message and "divisible" in message


def test_misspelt_option_suggests_the_right_one():
    with pytest.raises(mp.InvalidMixerOptions) as info:
        mp.create_mixer("attention", dim=64, num_head=4)
    assert "did you mean 'num_heads'" in str(info.value)


@pytest.mark.parametrize(
    "options, fragment",
    [
        ({"dim": 0}, "dim=0"),
        ({"dim": 64, "dropout": 1.5}, "dropout=1.5"),
        ({"dim": 64, "num_heads": "many"}, "num_heads='many'"),
        ({}, "dim: required option is missing"),
    ],
)
def test_invalid_option_values_name_the_option(options, fragment):
    with pytest.raises(mp.InvalidMixerOptions) as info:
        mp.create_mixer("attention", **options)
    assert fragment in str(info.value)


def test_config_is_immutable_and_recorded_on_the_module():
    mixer = mp.create_mixer("attention", 32, num_heads=2)
    assert mixer.config.num_heads == 2 and mixer.mixer_name == "attention"
    with pytest.raises(ValidationError, match="frozen"):
        mixer.config.num_heads = 4


def test_register_mixer_in_process_and_duplicates():
    from mixer_plugins.mixers.attention import AttentionConfig, SoftmaxAttention

    class NotebookConfig(AttentionConfig):
        pass

    @mp.register_mixer("notebook_attention", config=NotebookConfig, summary="in-process", aliases=("nb_attn",))
    class NotebookAttention(SoftmaxAttention):
        pass

    try:
        assert "notebook_attention" in mp.list_mixers()
        spec = mp.get_spec("nb_attn")
        assert spec.distribution == "<in-process>"
        assert isinstance(mp.create_mixer("notebook_attention", dim=16, num_heads=2), NotebookAttention)
        with pytest.raises(mp.DuplicateMixerError, match="notebook_attention"):
            mp.register_mixer(spec)
        with pytest.raises(mp.DuplicateMixerError, match="mixer-plugins"):
            mp.register_mixer(mp.MixerSpec(name="attention", config=NotebookConfig, builder=NotebookAttention))
        mp.register_mixer(spec, replace=True)
    finally:
        mp.unregister_mixer("notebook_attention")
    assert "notebook_attention" not in mp.list_mixers()


def test_spec_validation_is_strict():
    from mixer_plugins.mixers.attention import AttentionConfig, SoftmaxAttention

    with pytest.raises(TypeError, match="identifier"):
        mp.MixerSpec(name="bad name", config=AttentionConfig, builder=SoftmaxAttention)
    with pytest.raises(TypeError, match="MixerConfig"):
        mp.MixerSpec(name="x", config=dict, builder=SoftmaxAttention)
    with pytest.raises(TypeError, match="direction"):
        mp.MixerSpec(name="x", config=AttentionConfig, builder=SoftmaxAttention, direction="sideways")


def test_options_table_has_types_defaults_and_help():
    class Cfg(mp.MixerConfig):
        width: int = Field(3, gt=0, description="a width")

    spec = mp.MixerSpec(name="tbl", config=Cfg, builder=lambda c: None)
    rows = {r[0]: r for r in spec.options_table()}
    assert rows["width"] == ("width", "int", "3", "a width (> 0)")
    assert rows["dim"][2] == "(required)"


# -- throwaway distributions ------------------------------------------------------------------------

@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    """A fresh folder on sys.path for fake distributions; the default registry is refreshed around it."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    mp.default_registry.refresh()
    yield site
    monkeypatch.undo()
    mp.default_registry.refresh()
    for name in list(sys.modules):
        if name.startswith("fake_mixer_"):
            del sys.modules[name]


def test_broken_plugin_is_reported_and_the_others_still_work(fake_site):
    make_fake_distribution(fake_site, "broken-mixers", {"broken": "fake_mixer_broken:SPEC"},
                           {"fake_mixer_broken": "raise ImportError('needs a GPU library')"})
    make_fake_distribution(fake_site, "good-mixers", {"good": "fake_mixer_good:SPEC"},
                           {"fake_mixer_good": spec_module("good")})
    registry = MixerRegistry()
    assert {"broken", "good", "attention"} <= set(registry.names())
    with pytest.warns(mp.MixerPluginWarning, match="broken-mixers"):
        specs = registry.specs()
    names = {s.name for s in specs}
    assert "good" in names and "attention" in names and "broken" not in names
    [problem] = [p for p in registry.problems() if p.name == "broken"]
    assert problem.kind == "broken" and "broken-mixers" in problem.message and "needs a GPU library" in problem.message
    with pytest.raises(mp.PluginLoadError, match="needs a GPU library") as info:
        registry.create("broken", 16)
    assert info.value.distribution == "broken-mixers"
    assert registry.create("good", 16, num_heads=2) is not None


def test_entry_point_to_something_that_is_not_a_spec(fake_site):
    make_fake_distribution(fake_site, "odd-mixers", {"odd": "fake_mixer_odd:SPEC", "misnamed": "fake_mixer_mis:SPEC"},
                           {"fake_mixer_odd": "SPEC = 42", "fake_mixer_mis": spec_module("other_name")})
    registry = MixerRegistry()
    with pytest.raises(mp.PluginLoadError, match="must point to a mixer_plugins.MixerSpec, got int"):
        registry.get_spec("odd")
    with pytest.raises(mp.PluginLoadError, match="named 'misnamed' but its spec is named 'other_name'"):
        registry.get_spec("misnamed")


def test_name_claimed_twice_names_both_distributions(fake_site):
    make_fake_distribution(fake_site, "dup-one", {"twin": "fake_mixer_twin1:SPEC"},
                           {"fake_mixer_twin1": spec_module("twin")})
    make_fake_distribution(fake_site / "..", "dup-two", {"twin": "fake_mixer_twin2:SPEC"},
                           {"fake_mixer_twin2": spec_module("twin")})
    sys.path.insert(0, str((fake_site / "..").resolve()))
    try:
        registry = MixerRegistry()
        with pytest.raises(mp.DuplicateMixerError) as info:
            registry.create("twin", 16, num_heads=2)
        assert "dup-one" in str(info.value) and "dup-two" in str(info.value)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", mp.MixerPluginWarning)
            assert "attention" in {s.name for s in registry.specs()}
        assert any(p.kind == "duplicate" and p.name == "twin" for p in registry.problems())
    finally:
        sys.path.remove(str((fake_site / "..").resolve()))


def test_builtin_name_claimed_by_a_plugin_is_an_error_naming_both(fake_site):
    make_fake_distribution(fake_site, "hijacker", {"attention": "fake_mixer_hijack:SPEC"},
                           {"fake_mixer_hijack": spec_module("attention")})
    registry = MixerRegistry()
    with pytest.raises(mp.DuplicateMixerError) as info:
        registry.get_spec("attention")
    assert "mixer-plugins" in str(info.value) and "hijacker" in str(info.value)


def test_alias_claimed_twice_is_an_error(fake_site):
    make_fake_distribution(fake_site, "alias-a", {"first": "fake_mixer_a:SPEC"},
                           {"fake_mixer_a": spec_module("first", ("shared_alias",))})
    make_fake_distribution(fake_site, "alias-b", {"second": "fake_mixer_b:SPEC"},
                           {"fake_mixer_b": spec_module("second", ("shared_alias",))})
    registry = MixerRegistry()
    with pytest.raises(mp.DuplicateMixerError, match="alias-a.*alias-b|alias-b.*alias-a"):
        registry.get_spec("shared_alias")
    assert any(p.kind == "alias-conflict" for p in registry.problems())
    assert registry.get_spec("first").name == "first"


def test_cli_list_with_a_broken_plugin_lists_the_others(fake_site):
    make_fake_distribution(fake_site, "broken-mixers", {"broken": "fake_mixer_broken2:SPEC"},
                           {"fake_mixer_broken2": "import does_not_exist_anywhere"})
    env_path = str(fake_site)
    code = "import sys; from mixer_plugins.tools.cli import main; sys.exit(main(['list']))"
    import os

    env = dict(os.environ, PYTHONPATH=env_path + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "attention" in out.stdout and "ema" in out.stdout
    assert "broken" not in out.stdout
    assert "broken-mixers" in out.stderr and "does_not_exist_anywhere" in out.stderr


def test_misspelt_option_suggests_the_current_name():
    with pytest.raises(mp.InvalidMixerOptions, match="did you mean 'head_dim'"):
        mp.create_mixer("quasi", 32, head_dm=16)


# -- a plugin never takes over a built-in name or alias, and never ends the process ------------------------------------

def test_plugin_cannot_take_over_a_builtin_alias(fake_site):
    # The plugin claims the built-in name (a duplicate) and, through another mixer, the built-in's alias.
    make_fake_distribution(fake_site, "takeover", {"attention": "fake_mixer_take1:SPEC",
                                                   "my_attention": "fake_mixer_take2:SPEC"},
                           {"fake_mixer_take1": spec_module("attention"),
                            "fake_mixer_take2": spec_module("my_attention", ("mha",))})
    registry = MixerRegistry()
    spec = registry.get_spec("mha")  # the built-in's alias stays the built-in's, and no plugin is imported for it
    assert spec.name == "attention" and spec.distribution == "mixer-plugins"
    assert "fake_mixer_take2" not in sys.modules
    problems = {(p.name, p.kind) for p in registry.problems()}
    assert ("attention", "duplicate") in problems and ("mha", "alias-conflict") in problems
    [mha] = [p for p in registry.problems() if p.name == "mha"]
    assert set(mha.distributions) == {"mixer-plugins", "takeover"}
    assert registry.get_spec("my_attention").distribution == "takeover"


def test_builtin_alias_resolves_to_its_declaring_distribution(fake_site):
    # A plugin duplicating the name 'attention' does not make the built-in's alias unusable or the plugin's.
    make_fake_distribution(fake_site, "dup-attention", {"attention": "fake_mixer_dupattn:SPEC"},
                           {"fake_mixer_dupattn": spec_module("attention")})
    registry = MixerRegistry()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mp.MixerPluginWarning)
        spec = registry.get_spec("mha")
    assert spec.name == "attention" and spec.distribution == "mixer-plugins"
    with pytest.raises(mp.DuplicateMixerError):
        registry.get_spec("attention")


def test_plugin_mixer_named_like_a_builtin_alias_is_ambiguous_and_reported(fake_site):
    make_fake_distribution(fake_site, "shadow", {"mha": "fake_mixer_shadow:SPEC"},
                           {"fake_mixer_shadow": spec_module("mha")})
    registry = MixerRegistry()
    with pytest.raises(mp.DuplicateMixerError) as info:
        registry.get_spec("mha")
    assert "mixer-plugins" in str(info.value) and "shadow" in str(info.value)
    assert any(p.name == "mha" and p.kind == "alias-conflict" for p in registry.problems())


def test_plugin_alias_equal_to_a_builtin_name_never_takes_it_and_is_reported(fake_site):
    """A plugin's alias is only known once the plugin is imported, and looking up a built-in imports no plugin: the
    built-in keeps its name, and the clash is reported."""
    make_fake_distribution(fake_site, "shadow", {"shadow_mixer": "fake_mixer_shadow:SPEC"},
                           {"fake_mixer_shadow": spec_module("shadow_mixer", ("attention",))})
    registry = MixerRegistry()
    spec = registry.get_spec("attention")
    assert spec.distribution == "mixer-plugins" and "fake_mixer_shadow" not in sys.modules
    [problem] = [p for p in registry.problems() if p.name == "attention"]
    assert problem.kind == "alias-conflict" and set(problem.distributions) == {"mixer-plugins", "shadow"}
    assert registry.get_spec("attention").distribution == "mixer-plugins"  # still, with the plugin imported
    assert registry.get_spec("shadow_mixer").distribution == "shadow"


def test_plugin_raising_system_exit_at_import_is_a_reported_problem(fake_site):
    make_fake_distribution(fake_site, "exiting-mixers", {"exiting": "fake_mixer_exit:SPEC"},
                           {"fake_mixer_exit": "raise SystemExit('plugin gave up')"})
    registry = MixerRegistry()
    with pytest.warns(mp.MixerPluginWarning, match="exiting-mixers"):
        assert "attention" in {s.name for s in registry.specs()}  # imports every plugin
    [problem] = [p for p in registry.problems() if p.name == "exiting"]
    assert problem.kind == "broken" and "SystemExit" in problem.message and "plugin gave up" in problem.message
    with pytest.raises(mp.PluginLoadError, match="plugin gave up"):
        registry.get_spec("exiting")


@pytest.mark.parametrize("exc", ["SystemExit(3)", "BaseException('odd')"])
def test_cli_list_survives_a_plugin_raising_base_exceptions(fake_site, exc):
    import os

    make_fake_distribution(fake_site, "exiting-mixers", {"exiting": "fake_mixer_exit2:SPEC"},
                           {"fake_mixer_exit2": f"raise {exc}"})
    code = "import sys; from mixer_plugins.tools.cli import main; sys.exit(main(['list']))"
    env = dict(os.environ, PYTHONPATH=str(fake_site) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "attention" in out.stdout and "exiting-mixers" in out.stderr


# -- plugins are isolated: a lookup imports only what it needs, and a plugin's import leaves torch's settings alone ---

SLOW_PLUGIN = "import time\ntime.sleep(3)\n" + spec_module("slow_one")


def test_a_builtin_lookup_imports_no_plugin(fake_site):
    """Neither a built-in's name nor its alias imports a plugin, so a plugin that is slow to import (here 3 s of
    sleep) does not slow creating a built-in mixer."""
    make_fake_distribution(fake_site, "slow-mixers", {"slow_one": "fake_mixer_slow:SPEC"},
                           {"fake_mixer_slow": SLOW_PLUGIN})
    registry = MixerRegistry()
    assert registry.get_spec("attention").distribution == "mixer-plugins"
    assert registry.get_spec("mha").name == "attention"
    assert registry.create("quasi", 16, head_dim=8, d_state=4) is not None
    assert "fake_mixer_slow" not in sys.modules
    assert "slow_one" in registry.names()  # listed all the same, from the metadata


def test_creating_a_plugin_mixer_imports_only_its_distribution(fake_site):
    make_fake_distribution(fake_site, "iso-one", {"iso_one": "fake_mixer_iso_one:SPEC"},
                           {"fake_mixer_iso_one": spec_module("iso_one", ("first_iso",))})
    make_fake_distribution(fake_site, "iso-two", {"iso_two": "fake_mixer_iso_two:SPEC"},
                           {"fake_mixer_iso_two": spec_module("iso_two")})
    registry = MixerRegistry()
    mixer = registry.create("iso_one", 16, num_heads=2)
    assert mixer.mixer_name == "iso_one"
    assert "fake_mixer_iso_one" in sys.modules and "fake_mixer_iso_two" not in sys.modules
    # An alias only a plugin declares is found by importing the plugins (aliases are not in the metadata).
    assert registry.get_spec("first_iso").name == "iso_one"


def _torch_settings():
    import torch

    return (torch.get_default_dtype(), torch.get_num_threads(), torch.is_grad_enabled(),
            torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())


def _set_torch_settings(settings):
    import torch

    dtype, threads, grad, deterministic, warn_only = settings
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)
    torch.set_grad_enabled(grad)
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)


@pytest.mark.parametrize("change, described", [
    ("torch.set_default_dtype(torch.float64)", "default dtype torch.float64"),
    ("torch.set_num_threads(torch.get_num_threads() + 1)", "thread count"),
    ("torch.set_grad_enabled(False)", "grad mode False"),
    ("torch.use_deterministic_algorithms(True)", "deterministic algorithms"),
    ("torch.use_deterministic_algorithms(True, warn_only=True)", "deterministic algorithms"),
])
@pytest.mark.parametrize("then", ["spec", "raise"])
def test_a_plugin_changing_torch_settings_at_import_is_undone_and_named(fake_site, change, described, then):
    tail = spec_module("meddler") if then == "spec" else "raise ImportError('and then it broke')"
    make_fake_distribution(fake_site, "meddling-mixers", {"meddler": "fake_mixer_meddler:SPEC"},
                           {"fake_mixer_meddler": f"import torch\n{change}\n{tail}"})
    registry = MixerRegistry()
    before = _torch_settings()
    try:
        with pytest.warns(mp.MixerPluginWarning, match=f"meddling-mixers.*{described}") as record:
            if then == "spec":
                registry.get_spec("meddler")
            else:
                with pytest.raises(mp.PluginLoadError, match="and then it broke"):
                    registry.get_spec("meddler")
        assert _torch_settings() == before
        assert len([w for w in record if issubclass(w.category, mp.MixerPluginWarning)]) == 1
        # the host's own mixers are built with the host's settings
        mixer = mp.create_mixer("attention", 16, num_heads=2)
        assert all(p.dtype == before[0] for p in mixer.parameters())
    finally:
        _set_torch_settings(before)
