"""The data step of a run: the tokenizer and the train and held-out streams, built once."""
from dr_scale.data.loader import build_sources, resolve_files
from dr_scale.data.tokenizer import file_sha256, tokenizer_file_in
from dr_scale.errors import DrScaleError


def prepare_data(cfg, batch_sizes, resumed_run_dir=None, resume_at=(0, 0)):
    """Tokenizer + train/held-out streams. What is built once (the bundled corpus on first use,
    the sample index caches) the first process to need it builds under a file lock while the
    others wait for it there, outside any collective (data/index_cache.py), then they read what
    it wrote. A resumed run must keep its tokenizer; `resume_at` (step, samples consumed) sizes
    the stream for the steps left at this run's global batch."""
    t = cfg.train
    step, consumed = resume_at
    train_samples = consumed + max(0, t.max_steps - step) * batch_sizes["global"]
    tokenizer_path, specs = resolve_files(cfg.data)
    sources = build_sources(cfg.data, t.seed, train_samples=train_samples,
                            eval_samples=t.eval_samples, tokenizer_path=tokenizer_path,
                            specs=specs)
    used = tokenizer_file_in(resumed_run_dir) if resumed_run_dir else None
    if used is not None and file_sha256(used) != sources.tokenizer.sha256:
        given = cfg.data.tokenizer or "the tokenizer trained on the bundled corpus"
        raise DrScaleError(f"{used}: the run was trained with this tokenizer, but the resumed "
                           f"config gives {given}; token ids would change meaning")
    return sources
