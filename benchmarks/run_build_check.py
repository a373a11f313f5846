#!/usr/bin/env python
"""A trained run's model, built again as the run built it (its own DeepSpeed config: ZeRO-3's
sharded construction for the bundled zero3) and loaded from its latest checkpoint as --resume
loads it, against a plain build holding the same weights: the largest difference of every
buffer, and of the logits on one sample of the run's full length.

    python benchmarks/run_build_check.py RUN_DIR [--port 29533]

One rank. The sample is token ids drawn from the vocabulary with a fixed seed. Prints one JSON
line: buffers (name -> largest difference, dtype), logits (largest difference, largest logit),
precision, sequence length.
"""
import argparse
import json
import os
from pathlib import Path

import torch


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("run_dir")
    p.add_argument("--port", type=int, default=29533)
    a = p.parse_args(argv)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), RANK="0",
                      LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    import deepspeed

    from dr_scale.config import ds_config as dsc
    from dr_scale.config import load_config
    from dr_scale.export.consolidate import consolidated_state_dict, run_shape
    from dr_scale.models import build_model
    from dr_scale.parallel.sharded_build import build_for_run
    from dr_scale.parallel.topology import Topology
    from dr_scale.models.kernel_choice import select_kernels
    from dr_scale.checkpoint.layout import find_tag
    from dr_scale.checkpoint.load import load
    from dr_scale.train.engine import initialize_engine

    deepspeed.init_distributed(dist_backend="gloo")
    run = Path(a.run_dir)
    cfg = load_config(run / "config.yaml", [])
    ds = json.loads((run / "ds_config.json").read_text())
    precision = dsc.precision(ds)
    topo = Topology(1)
    shape, _ = select_kernels(run_shape(run), cfg, "cpu", precision, topo)
    torch.manual_seed(cfg.train.seed)
    engine = initialize_engine(build_for_run(shape, ds, topo), ds, cfg.train, None,
                               run / "ds_config.json")
    load(engine, run / "checkpoints", topo, expected_model=shape.weights_signature())
    tag = find_tag(run / "checkpoints")
    plain = build_model(shape).eval()
    plain.load_state_dict(consolidated_state_dict(run / "checkpoints", tag, shape))
    if precision != "fp32":
        for param in plain.parameters():
            param.data = param.data.to(dsc.torch_dtype(precision))
    seq = cfg.data.seq_length
    tokens = torch.randint(0, shape.vocab_size, (1, seq),
                           generator=torch.Generator().manual_seed(0))
    engine.module.eval()
    with torch.no_grad():
        got, want = engine(tokens).double(), plain(tokens).double()
    built = dict(engine.module.named_buffers())
    print(json.dumps({
        "run": str(run), "checkpoint": tag, "precision": precision, "seq_length": seq,
        "buffers": {n: {"max_diff": (built[n].double() - b.double()).abs().max().item(),
                        "dtype": str(built[n].dtype)} for n, b in plain.named_buffers()},
        "logits": {"max_diff": (got - want).abs().max().item(),
                   "max_logit": want.abs().max().item(), "bitwise": bool(torch.equal(got, want))},
    }))


if __name__ == "__main__":
    main()
