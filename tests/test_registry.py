import pytest

from dr_scale.errors import DrScaleError
from dr_scale.registry import ATTENTION_REGISTRY, DATASET_REGISTRY, MODEL_REGISTRY, Registry


def test_register_by_name_and_by_decorator():
    reg = Registry("widget")

    @reg.register()
    class Foo:
        pass

    @reg.register("bar")
    def make_bar(x):
        return x * 2

    assert reg.get("Foo") is Foo
    assert reg.build("bar", 21) == 42
    assert reg.names() == ["Foo", "bar"]


def test_unknown_name_lists_known_ones():
    reg = Registry("widget")
    reg.register("a", obj=int)
    reg.register("b", obj=float)
    with pytest.raises(DrScaleError, match=r"unknown widget 'c'; known: a, b"):
        reg.get("c")


def test_name_clash_is_refused():
    reg = Registry("widget")
    reg.register("a", obj=int)
    with pytest.raises(DrScaleError, match="already registered"):
        reg.register("a", obj=float)


def test_builtin_registrations():
    import dr_scale.models  # noqa: F401
    import dr_scale.data.dataset  # noqa: F401

    assert {"llama", "gpt2"} <= set(MODEL_REGISTRY.names())
    assert {"sdpa", "eager"} <= set(ATTENTION_REGISTRY.names())
    assert "packed" in DATASET_REGISTRY
