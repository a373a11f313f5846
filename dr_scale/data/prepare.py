"""The data step of a run: the tokenizer and the train and held-out streams, built once per node."""
import os

from dr_scale.runtime import comm
from dr_scale.data.loader import build_sources, resolve_files
from dr_scale.data.tokenizer import file_sha256, tokenizer_file_in
from dr_scale.errors import DrScaleError


def prepare_data(cfg, batch_sizes, resumed_run_dir=None, resume_at=(0, 0)):
    """Tokenizer + train/held-out streams. Local rank 0 builds what is built once (the bundled
    corpus on first use, the sample index caches) while the node's other ranks wait, then they
    map what it wrote. A resumed run must keep its tokenizer; `resume_at` (step, samples
    consumed) sizes the stream for the steps left at this run's global batch."""
    t = cfg.train
    step, consumed = resume_at
    train_samples = consumed + max(0, t.max_steps - step) * batch_sizes["global"]

    def sources_here(builder: bool):
        files = resolve_files(cfg.data)
        return build_sources(cfg.data, t.seed, train_samples=train_samples,
                             eval_samples=t.eval_samples, tokenizer_path=files[0], specs=files[1],
                             build_index=builder)
    builder = int(os.environ.get("LOCAL_RANK", "0")) == 0
    sources = sources_here(True) if builder else None
    comm.barrier()
    if sources is None:
        sources = sources_here(False)
    used = tokenizer_file_in(resumed_run_dir) if resumed_run_dir else None
    if used is not None and file_sha256(used) != sources.tokenizer.sha256:
        given = cfg.data.tokenizer or "the tokenizer trained on the bundled corpus"
        raise DrScaleError(f"{used}: the run was trained with this tokenizer, but the resumed "
                           f"config gives {given}; token ids would change meaning")
    return sources
