"""Config: _base_ chains, ${env:...}, dotted overrides, typed validation, freeze, snapshot."""
import textwrap

import pytest
import yaml
from hypothesis import given, settings, strategies as st

from dr_scale.config import load_config
from dr_scale.config.merge import deep_merge
from dr_scale.errors import DrScaleError


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def test_embedded_default_matches_configs_base_yaml():
    from tests.conftest import ROOT

    assert load_config().to_dict() == load_config(ROOT / "configs" / "base.yaml").to_dict()


def test_base_chain_with_relative_paths(tmp_path):
    write(tmp_path / "common" / "root.yaml", """
        train: {lr: 0.1, max_steps: 10}
        model: {preset: tiny, dropout: 0.1}
    """)
    write(tmp_path / "mid.yaml", """
        _base_: common/root.yaml
        train: {lr: 0.2}
    """)
    leaf = write(tmp_path / "exp" / "leaf.yaml", """
        _base_: ../mid.yaml
        train: {max_steps: 30}
    """)
    cfg = load_config(leaf)
    assert (cfg.train.lr, cfg.train.max_steps, cfg.model.dropout) == (0.2, 30, 0.1)


def test_multiple_bases_later_wins(tmp_path):
    write(tmp_path / "a.yaml", "train: {lr: 0.1, seed: 1}\n")
    write(tmp_path / "b.yaml", "train: {lr: 0.2}\n")
    cfg = load_config(write(tmp_path / "c.yaml", "_base_: [a.yaml, b.yaml]\n"))
    assert (cfg.train.lr, cfg.train.seed) == (0.2, 1)


def test_base_cycle_is_one_line_error(tmp_path):
    write(tmp_path / "a.yaml", "_base_: b.yaml\n")
    write(tmp_path / "b.yaml", "_base_: a.yaml\n")
    with pytest.raises(DrScaleError, match=r"inheritance cycle: .*a\.yaml -> .*b\.yaml -> .*a\.yaml") as e:
        load_config(tmp_path / "a.yaml")
    assert "\n" not in str(e.value)


def test_missing_base_names_file(tmp_path):
    f = write(tmp_path / "a.yaml", "_base_: nowhere.yaml\n")
    with pytest.raises(DrScaleError, match=r"a\.yaml: _base_: base file not found: .*nowhere\.yaml"):
        load_config(f)


def test_env_interpolation(tmp_path):
    f = write(tmp_path / "a.yaml", """
        data: {cache_dir: "${env:MY_ROOT}/cache", seq_length: "${env:SEQ,64}"}
        train: {lr: "${env:LR,3e-4}"}
    """)
    cfg = load_config(f, env={"MY_ROOT": "/data"})
    assert (cfg.data.cache_dir, cfg.data.seq_length, cfg.train.lr) == ("/data/cache", 64, 3e-4)
    cfg = load_config(f, env={"MY_ROOT": "/d", "SEQ": "128"})
    assert cfg.data.seq_length == 128


def test_env_missing_without_default_names_file_key_and_var(tmp_path):
    f = write(tmp_path / "a.yaml", "data: {cache_dir: '${env:NOPE_VAR}/x'}\n")
    with pytest.raises(DrScaleError, match=r"a\.yaml: data\.cache_dir: environment variable "
                                           r"NOPE_VAR is not set"):
        load_config(f, env={})


def test_overrides_beat_files(tmp_path):
    f = write(tmp_path / "a.yaml", "train: {lr: 0.1}\n")
    cfg = load_config(f, ["train.lr=0.5", "model.preset=gpt2_tiny", "logging.wandb=true"])
    assert (cfg.train.lr, cfg.model.preset, cfg.logging.wandb) == (0.5, "gpt2_tiny", True)


@pytest.mark.parametrize("yaml_text, override, pattern", [
    ("train: {lrr: 0.1}\n", None, r"a\.yaml: train\.lrr: unknown key \(did you mean 'train\.lr'\?\)"),
    ("train: {lr: fast}\n", None, r"a\.yaml: train\.lr: expected a number, got 'fast'"),
    ("train: {max_steps: 1.5}\n", None, r"a\.yaml: train\.max_steps: expected an integer, got 1\.5"),
    ("train: {max_steps: 0}\n", None, r"a\.yaml: train\.max_steps: expected a value >= 1, got 0"),
    ("logging: {wandb: 'yes'}\n", None, r"a\.yaml: logging\.wandb: expected true or false"),
    ("model: 3\n", None, r"a\.yaml: model: expected a mapping, got 3"),
    ("train: {lr: 0.1}\n", "train.warmup_steps=-1", r"command line: train\.warmup_steps: expected a value >= 0"),
    ("train: {lr: 0.1}\n", "trian.lr=1", r"command line: trian: unknown key \(did you mean 'train'\?\)"),
    ("train: {lr: 0.1}\n", "train.lr", r"command line: 'train\.lr': expected dotted\.key=value"),
    ("train: [1, 2\n", None, r"a\.yaml: YAML syntax error at line 2"),
    ("- 1\n- 2\n", None, r"a\.yaml: expected a mapping at the top level"),
])
def test_bad_input_is_one_line_naming_file_and_key(tmp_path, yaml_text, override, pattern):
    f = write(tmp_path / "a.yaml", yaml_text)
    with pytest.raises(DrScaleError, match=pattern) as e:
        load_config(f, [override] if override else [])
    assert "\n" not in str(e.value)


def test_value_from_base_error_names_the_base_file(tmp_path):
    write(tmp_path / "base.yaml", "train: {lr: oops}\n")
    f = write(tmp_path / "leaf.yaml", "_base_: base.yaml\ntrain: {seed: 3}\n")
    with pytest.raises(DrScaleError, match=r"base\.yaml: train\.lr: expected a number"):
        load_config(f)


def test_freeze_blocks_every_write():
    cfg = load_config(overrides=["callbacks={ema: {enabled: true}}"])
    cfg.freeze()
    with pytest.raises(DrScaleError, match="frozen"):
        cfg.train.lr = 1.0
    with pytest.raises(DrScaleError, match="frozen"):
        cfg.model = None
    with pytest.raises(DrScaleError, match="frozen"):
        cfg.callbacks["ema"] = {}
    assert cfg.train.lr == 3e-3


def test_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = load_config(overrides=["train.lr=0.01", "data.datasets=[{prefix: /a, weight: 2}]",
                                 "data.tokenizer=/t.model"])
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    assert load_config(path).to_dict() == cfg.to_dict()


# -- property: deep_merge -----------------------------------------------------------------------
keys = st.sampled_from(list("abcde"))
leaves = st.one_of(st.integers(), st.text(max_size=3), st.booleans())
trees = st.recursive(leaves, lambda kids: st.dictionaries(keys, kids, max_size=4), max_leaves=12)
dicts = st.dictionaries(keys, trees, max_size=4)


def lookup(d, path):
    for p in path:
        d = d[p]
    return d


def leaf_paths(d, prefix=()):
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from leaf_paths(v, prefix + (k,))
        else:
            yield prefix + (k,), v


@settings(max_examples=200, deadline=None)
@given(dicts, dicts)
def test_merge_top_wins_on_every_leaf_and_base_survives_elsewhere(base, top):
    merged = deep_merge(base, top, {}, "top")
    for path, value in leaf_paths(top):
        if value != {}:  # an empty mapping sets nothing: it merges into whatever is there
            assert lookup(merged, path) == value
    for path, value in leaf_paths(base):
        # A base leaf survives unless top set a prefix of its path to a non-mapping, or set it.
        overridden = any(
            not isinstance(lookup(top, path[:i]) if _has(top, path[:i]) else {}, dict)
            for i in range(1, len(path) + 1))
        if not overridden and not _has(top, path):
            assert lookup(merged, path) == value


@settings(max_examples=100, deadline=None)
@given(dicts, dicts)
def test_merge_identity_and_idempotence(a, b):
    assert deep_merge({}, b, {}, "b") == b
    assert deep_merge(a, {}, {}, "empty") == a
    once = deep_merge(a, b, {}, "b")
    assert deep_merge(once, b, {}, "b") == once
    assert a == deep_merge(a, {}, {}, "x")  # inputs are not mutated


def _has(d, path):
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return False
        d = d[p]
    return True
