"""Run by tests/test_sharded_build.py on 2 ranks (torch.multiprocessing, gloo): a model built on
the meta device and made real only where this rank keeps it, under tensor parallelism (its
slices) and pipeline parallelism (its stage), against the same model built whole from the same
seed and split by DeepSpeed itself; and a Hugging Face folder (model.init_from) read into the
slices."""
import os
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp
from rank_result import write_and_leave


def materialize_counting_draws(module):
    """materialize(module), and the elements drawn for each parameter name: the tiles whose
    generators were seeded, by their sizes."""
    from dr_scale.models import initial_values as iv
    from dr_scale.parallel.sharded_build import ORIGIN, materialize

    seeded, real = set(), iv._generator
    iv._generator = lambda seed, name, band, chunk: seeded.add((name, band, chunk)) or \
        real(seed, name, band, chunk)
    try:
        made = materialize(module)
    finally:
        iv._generator = real
    drawn = {}
    for p in module.parameters():
        name, whole_shape, _ = getattr(p, ORIGIN)
        tiling = iv.Tiling(whole_shape)
        drawn[name] = sum(len(rows) * len(columns) for band, chunk, rows, columns
                          in tiling.tiles(range(tiling.rows), range(tiling.columns))
                          if (name, band, chunk) in seeded)
    return made, drawn


def rank_main(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    import deepspeed
    from safetensors.torch import save_file

    from dr_scale.config.schema import ModelConfig
    from dr_scale.export.safetensors_folder import HFWeights
    from dr_scale.models import build_model, resolve_shape
    from dr_scale.models.build import count_parameters
    from dr_scale.parallel.pipeline import to_pipeline
    from dr_scale.parallel.sharded_build import build_for_run, materialize
    from dr_scale.parallel.tensor import autotp_section, shard_model
    from dr_scale.parallel.topology import Topology

    deepspeed.init_distributed(dist_backend="gloo")
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}}
    result = {}

    def split(model, shape, topo):  # what parallelize does before materialize
        if topo.autotp:
            shard_model(model, shape, topo, autotp_section(shape, topo.tensor, True), vocab_parallel=True)
            return model
        return to_pipeline(model, shape, topo)

    for preset, layout in (("tiny", "tp2"), ("gpt2_tiny", "tp2"), ("tiny", "pp2")):
        shape = resolve_shape(ModelConfig(preset=preset), 4096)
        topo = (Topology(2, tensor=2) if layout == "tp2" else Topology(2, pipeline=2)).with_groups()
        torch.manual_seed(1234)
        meta = build_for_run(shape, ds, topo)
        built_meta = all(p.is_meta for p in meta.parameters())
        mine = split(meta, shape, topo)
        made, drawn = materialize_counting_draws(mine)
        torch.manual_seed(1234)
        whole = build_model(shape)
        stats = {n: (p.mean().item(), p.std().item()) for n, p in whole.named_parameters()}
        reference = split(whole, shape, topo)  # DeepSpeed splits the real values
        rows = {}
        for (name, p), (ref_name, q) in zip(mine.named_parameters(), reference.named_parameters()):
            assert name == ref_name
            origin_name, whole_shape, _ = p.dr_origin
            rows[name] = {"equal": bool(torch.equal(p, q)), "meta": p.is_meta,
                          "shape": list(p.shape), "numel": p.numel(),
                          "columns_cut": list(p.shape)[-1:] != list(whole_shape)[-1:],
                          "drawn": drawn.get(origin_name, 0)}
        # what this rank never made: the other stage's layers stay on meta
        left = sum(p.numel() for p in meta.parameters() if p.is_meta)
        case = {"params": rows, "made": made, "held": sum(p.numel() for p in mine.parameters()),
                "left_on_meta": left, "total": count_parameters(build_model(shape, "meta")),
                "built_meta": built_meta, "whole_stats": stats}
        if layout == "tp2":  # the slices read from a folder (model.init_from)
            folder = Path(f"{out}.hf{rank}.{preset}")
            folder.mkdir()
            torch.manual_seed(99)
            source = {k: torch.randn(v.shape) for k, v in build_model(shape).state_dict().items()
                      if not (shape.tie_embeddings and k == "lm_head.weight")}
            save_file(source, str(folder / "model.safetensors"))
            torch.manual_seed(1234)
            loaded = split(build_for_run(shape, ds, topo), shape, topo)
            materialize(loaded, HFWeights(folder))
            from_file = build_model(shape, "meta")
            from_file.load_state_dict(source, strict=False, assign=True)
            if shape.tie_embeddings:
                from_file.lm_head.weight = from_file.get_parameter(
                    next(k for k in source if "wte" in k or "embed_tokens" in k))
            want = split(from_file, shape, topo)
            case["loaded"] = {n: bool(torch.equal(p, q)) for (n, p), (_, q)
                              in zip(loaded.named_parameters(), want.named_parameters())}
        result[f"{preset}/{layout}"] = case
    write_and_leave(out, rank, result)


if __name__ == "__main__":
    mp.spawn(rank_main, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2)
