import pytest

from dr_scale.errors import DrScaleError
from dr_scale.registry import DATASET_REGISTRY, MODEL_REGISTRY, Registry


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

    assert {"llama", "qwen2", "gpt2"} <= set(MODEL_REGISTRY.names())
    assert "packed" in DATASET_REGISTRY


def test_one_attention_table_for_auto_and_the_model():
    """`model.attention` resolves in the kernel registry, the table `auto` chooses from: a kernel
    registered there is usable by name and by the model; an unknown name lists that table."""
    import torch

    from dr_scale.kernels import policy, reference
    from dr_scale.kernels.registry import KERNELS, TORCH, implementation, register_kernel, select
    from dr_scale.models import build_model
    from tests.test_models import shape_of

    calls = []

    def counted(q, k, v, causal=True, dropout_p=0.0, training=False):
        calls.append(q.shape)
        return reference.attention(q, k, v, causal=causal)

    register_kernel("attention", "counted_for_test", priority=TORCH - 1, devices=("cpu",),
                    policy=policy.ATTENTION)(counted)
    try:
        assert select("attention", "cpu").name in KERNELS["attention"]
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        torch.manual_seed(0)
        mine = build_model(shape_of("model.attention=counted_for_test", vocab=64))
        torch.manual_seed(0)
        sdpa = build_model(shape_of("model.attention=sdpa", vocab=64))
        with torch.no_grad():
            torch.testing.assert_close(mine(ids), sdpa(ids), atol=1e-5, rtol=1e-5)
        assert len(calls) == mine.shape.num_layers
        with pytest.raises(DrScaleError, match="model.attention: unknown attention implementation "
                                               "'flash9'; known: counted_for_test, eager, sdpa, "
                                               "sdpa_cudnn, sdpa_flash, triton_flash$"):
            shape_of("model.attention=flash9", vocab=64)
        assert implementation("attention", "eager").fn is reference.attention
    finally:
        del KERNELS["attention"]["counted_for_test"]
