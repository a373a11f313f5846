"""ZeRO-3's gradient hooks made without gathering the model (dr_scale/parallel/zero3_hooks.py):
a real DeepSpeed ZeRO-3 engine on a one-rank gloo group, made with and without the wrapper, in
a fresh interpreter each."""
import json
import subprocess
import sys

from tests.conftest import free_port

SCRIPT = r"""
import contextlib, json, os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1",
                  LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
import deepspeed, torch
from deepspeed.runtime.zero import partition_parameters
from dr_scale.parallel.zero3_hooks import hooks_without_gathering

deepspeed.init_distributed("gloo")
gathered = []
original = partition_parameters.Init._all_gather
def counted(self, param_list, *args, **kwargs):
    gathered.extend(p.ds_id for p in param_list)
    return original(self, param_list, *args, **kwargs)
partition_parameters.Init._all_gather = counted

ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000}}
torch.manual_seed(0)
with deepspeed.zero.Init(config_dict_or_path=ds):
    # the two 64 x 64 weights are partitioned; the biases and the 64 x 1 weight stay whole
    # (persistent: at most 1,000 elements)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                torch.nn.Tanh(), torch.nn.Linear(64, 1))
at_init = len(gathered)
wrapper = hooks_without_gathering() if sys.argv[1] == "wrapped" else contextlib.nullcontext()
with wrapper:
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
during = len(gathered) - at_init
x, y = torch.randn(4, 64), torch.randn(4, 1)
losses = []
for _ in range(3):
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
print(json.dumps({"gathered_at_start": during, "losses": losses,
                  "hooks": len(engine.optimizer._grad_acc_hooks)}))
"""


def engine_made(how: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, how, str(free_port())],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_zero3_engine_starts_without_gathering_the_model_and_trains_the_same():
    """DeepSpeed's own start gathers every parameter while hooking it; wrapped, the two
    partitioned weights are not gathered (the four persistent parameters are, as before), every
    parameter still gets its hook, and three steps give the same losses exactly."""
    plain, wrapped = engine_made("plain"), engine_made("wrapped")
    assert plain["gathered_at_start"] == 6, plain  # all: 2 partitioned + 4 persistent
    assert wrapped["gathered_at_start"] == 4, wrapped  # the persistent ones only
    assert plain["hooks"] == wrapped["hooks"] == 6
    assert wrapped["losses"] == plain["losses"]
    assert plain["losses"][-1] < plain["losses"][0]  # the steps trained
