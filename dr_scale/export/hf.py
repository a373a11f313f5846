"""Hugging Face folders <-> our decoders, for every family whose ModelSpec has an `hf` format.

Llama and Qwen2 parameter names are the transformers architecture's, so their weights copy
across unchanged and only the config is translated (by the family's own functions, in its model
file). Where names or layouts differ (GPT-2: fused q/k/v, Conv1D's transposed matrices), the
family's `HFFormat.tensors` says how each of their tensors is made from ours and back; export
streams the copied ones and joins the others a tensor at a time.
"""
import json
import math
from pathlib import Path

import torch

from dr_scale.data.tokenizer import tokenizer_file_in
from dr_scale.errors import DrScaleError
from dr_scale.export.safetensors_folder import HFWeights, write_shards
from dr_scale.models.build import ModelShape, build_model, spec_of
from dr_scale.registry import MODEL_REGISTRY

CONFIG_FILE = "config.json"
DEFAULT_SHARD_BYTES = 5 * 10 ** 9  # "5GB", transformers' default


def hf_config(shape: ModelShape, eod_id: int) -> dict:
    fmt = spec_of(shape.arch).hf
    if fmt is None:
        raise DrScaleError(f"export: model arch '{shape.arch}' has no Hugging Face form here; "
                           f"families with one: {', '.join(_families_with_hf())}")
    return fmt.to_config(shape, eod_id)


def _families_with_hf():
    return [a for a in MODEL_REGISTRY.names() if MODEL_REGISTRY.get(a).hf is not None]


def shape_from_hf(config: dict, source: str) -> dict:
    """Model fields (for the `model:` config section) from a Hugging Face config.json, by the
    family whose format names its model_type."""
    for arch in _families_with_hf():
        fmt = MODEL_REGISTRY.get(arch).hf
        if config.get("model_type") == fmt.model_type:
            return fmt.from_config(config, source)
    known = ", ".join(repr(MODEL_REGISTRY.get(a).hf.model_type) for a in _families_with_hf())
    raise DrScaleError(f"{source}: model_type is {config.get('model_type')!r}, expected one of "
                       f"{known}")


def write_folder(out: Path, source, shape: ModelShape, tokenizer, dtype=torch.float32,
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES, progress=None):
    """config.json, the weights of `source` (an export.checkpoint_source.Source: a tensor at a
    time, in shards of at most `max_shard_bytes`; a tied head stored once) and the run's
    tokenizer (a data.tokenizer.load_tokenizer object)."""
    write_config(out, shape, tokenizer.eod_id, dtype)
    write_weights(out, source, shape, dtype, max_shard_bytes, progress)
    write_tokenizer(out, tokenizer)


def write_weights(out: Path, source, shape: ModelShape, dtype=torch.float32,
                  max_shard_bytes: int = DEFAULT_SHARD_BYTES, progress=None):
    """The weights of `source` under transformers' names and layouts (a tied head once)."""
    tensors = spec_of(shape.arch).hf.tensors
    if tensors is None:  # the same names and layouts: streamed as they are
        entries = [(n, s) for n, s in source.entries
                   if not (shape.tie_embeddings and n == "lm_head.weight")]
        write_shards(out, entries, source.pieces, dtype, max_shard_bytes, progress)
        return
    theirs = {t.name: t for t in tensors(shape)}
    stack = {}  # the last stacked tensor read, for its experts that follow it

    def pieces(name):
        t = theirs[name]
        if t.index is not None:
            if stack.get("name") != t.ours[0]:
                stack.update(name=t.ours[0], tensor=source.tensor(t.ours[0]))
            yield stack["tensor"][t.index].reshape(-1)
        elif t.join is None:
            yield from source.pieces(t.ours[0])
        else:
            yield t.join([source.tensor(n) for n in t.ours]).reshape(-1)
    write_shards(out, [(t.name, t.shape) for t in theirs.values()], pieces, dtype,
                 max_shard_bytes, progress)


class AdaptedWeights:
    """A folder's tensors under our names and layouts (what HFWeights offers: `shapes`,
    `read`), made from theirs by the family's `HFFormat.tensors`; a tensor of ours that comes
    from a joined one of theirs is made whole, then cut where a slice is asked for; one stacked
    from several of theirs (experts: `index`) is stacked whole, then cut."""

    def __init__(self, weights: HFWeights, tensors, our_shapes: dict):
        self.weights, self.folder = weights, weights.folder
        self.made_from, self.shapes = {}, {}
        for t in tensors:
            if t.name not in weights.shapes:
                continue  # missing: the model's check names what it lacks
            if weights.shapes[t.name] != t.shape:
                raise DrScaleError(f"{weights.file_of[t.name]}: {t.name} has shape "
                                   f"{weights.shapes[t.name]}, config.json makes it {t.shape}")
            for i, ours in enumerate(t.ours):
                if t.index is not None:
                    self.made_from.setdefault(ours, []).append(t)
                else:
                    self.made_from[ours] = (t, i)
                self.shapes[ours] = our_shapes[ours]
        unknown = sorted(set(weights.shapes) - {t.name for t in tensors})
        if unknown:
            raise DrScaleError(f"{self.folder}: weights do not fit the model (unexpected: "
                               f"{', '.join(unknown[:3])})")

    def read(self, name: str, start: int = 0, end: int = None) -> torch.Tensor:
        if isinstance(self.made_from[name], list):  # stacked from one tensor of theirs apiece
            parts = sorted(self.made_from[name], key=lambda t: t.index)
            if end is None and start == 0:
                return torch.stack([self.weights.read(t.name) for t in parts])
            each = math.prod(parts[0].shape)  # a slice (a ZeRO-3 partition): its experts only
            first, last = start // each, (end - 1) // each
            rows = torch.cat([self.weights.read(t.name).reshape(-1)
                              for t in parts[first:last + 1]])
            return rows[start - first * each:end - first * each]
        t, i = self.made_from[name]
        if t.split is None:
            return self.weights.read(t.name, start, end)
        whole = t.split(self.weights.read(t.name))[i].contiguous()
        return whole if end is None and start == 0 else whole.reshape(-1)[start:end]


def open_weights(folder, shape_fields: dict):
    """The folder's weights under our names: as they are, or through the family's adapter."""
    weights = HFWeights(folder)
    tensors = spec_of(shape_fields["arch"]).hf.tensors
    if tensors is None:
        return weights
    shape = ModelShape(**_complete(shape_fields))
    ours = {n: tuple(t.shape) for n, t in build_model(shape, "meta").state_dict().items()}
    if any(n.endswith(".experts.gate_up_proj") for n in weights.shapes):
        # transformers 5 saves a mixture of experts as it holds it: all experts in one tensor
        return AdaptedWeights(weights, tensors(shape, fused=True), ours)
    return AdaptedWeights(weights, tensors(shape), ours)


def _complete(fields: dict) -> dict:
    """A folder's model fields with the shape's remaining ones from the family's first preset
    (what its tensors' names and shapes do not depend on)."""
    preset = next(iter(spec_of(fields["arch"]).presets.values()))
    return {**preset, **{k: v for k, v in fields.items() if v is not None}}


def write_config(out: Path, shape: ModelShape, eod_id: int, dtype=torch.float32):
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(shape, eod_id)
    cfg["torch_dtype"] = cfg["dtype"] = str(dtype).replace("torch.", "")
    (out / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")


def write_tokenizer(out: Path, tokenizer):
    """A Hugging Face tokenizer.json as it is, with a tokenizer_config.json naming its end of
    text; a sentencepiece model, and transformers' tokenizer.json converted from it (so a reader
    needs no sentencepiece). Sentencepiece ids agree with ours except that transformers folds a
    leading space of the whole text into the dummy prefix."""
    import shutil

    from transformers import AutoTokenizer

    if tokenizer.kind == "huggingface":
        shutil.copyfile(tokenizer.path, out / "tokenizer.json")
        (out / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tokenizer.eod_token,
            "add_bos_token": False, "add_eos_token": False}) + "\n")
        return
    shutil.copyfile(tokenizer.path, out / "tokenizer.model")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False,
        "legacy": False, "eos_token": "</s>", "bos_token": "<s>", "unk_token": "<unk>"}) + "\n")
    AutoTokenizer.from_pretrained(str(out)).save_pretrained(str(out))


def read_folder(folder) -> tuple:
    """(model fields, HFWeights) from a Hugging Face folder: the config read, the weights only
    located (their headers read); load_into copies them a tensor at a time."""
    folder = Path(folder)
    cfg_path = folder / CONFIG_FILE
    if not cfg_path.is_file():
        raise DrScaleError(f"{cfg_path}: not found (model.init_from expects a Hugging Face folder)")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise DrScaleError(f"{cfg_path}: JSON syntax error at line {e.lineno}: {e.msg}") from None
    fields = shape_from_hf(config, str(cfg_path))
    return fields, open_weights(folder, fields)


def apply_init_from(cfg):
    """For `model.init_from`: take the shape from the folder's config.json (a field set in the
    YAML must agree) and its tokenizer when data.tokenizer is unset. Returns the weights
    (HFWeights: located, not read)."""
    folder = Path(cfg.model.init_from).expanduser()
    fields, weights = read_folder(folder)
    for key, value in fields.items():
        if key == "moe":  # a section of its own: field by field
            for sub_key, sub_value in value.items():
                _agree(cfg.model.moe, f"model.moe.{sub_key}", sub_key, sub_value, folder)
        else:
            _agree(cfg.model, f"model.{key}", key, value, folder)
    if cfg.data.tokenizer is None and tokenizer_file_in(folder) is not None:
        cfg.data.tokenizer = str(tokenizer_file_in(folder))
    return weights


def _agree(section, dotted: str, key: str, value, folder: Path):
    """A folder's value set where the config leaves it unset, else the two must agree."""
    mine = getattr(section, key)
    if mine is None:
        setattr(section, key, value)
    elif mine != value:
        raise DrScaleError(f"{dotted}={mine} disagrees with {folder / CONFIG_FILE} ({value}); "
                           "remove it from the config or pick another folder")


def load_into(model, weights: HFWeights, source: str):
    """Copy a folder's weights into our model a tensor at a time; a tied head may be absent from
    the files. A model built sharded (ZeRO-3's zero.Init) has each rank read only the elements
    of its own partition, straight from the file: nothing is gathered or broadcast. (A model
    built on meta under tensor or pipeline parallelism is checked here and filled by
    parallel/sharded_build.materialize once it is cut to this rank's part.)"""
    names = check_fits(model, weights, source)
    if next(model.parameters()).is_meta:
        return
    tensors = dict(model.state_dict(keep_vars=True))
    with torch.no_grad():
        for k in names:
            t = tensors[k]
            if hasattr(t, "ds_id"):
                _load_partition(t, weights, k)
            else:
                t.data.copy_(weights.read(k))


def check_fits(model, weights: HFWeights, source: str) -> list:
    """The folder's tensor names, once each is known to fit the model (a one-line refusal
    naming the first that does not)."""
    own = {k: tuple(getattr(t, "ds_shape", t.shape))  # a sharded parameter's whole shape
           for k, t in model.state_dict(keep_vars=True).items()}
    theirs = dict(weights.shapes)
    if getattr(model.shape, "tie_embeddings", False):
        theirs.pop("lm_head.weight", None)
        own.pop("lm_head.weight", None)
    missing = sorted(set(own) - set(theirs))
    unexpected = sorted(set(theirs) - set(own))
    if missing or unexpected:
        raise DrScaleError(f"{source}: weights do not fit the model (missing: "
                           f"{', '.join(missing[:3]) or 'none'}; unexpected: "
                           f"{', '.join(unexpected[:3]) or 'none'})")
    for k, shape in theirs.items():
        if own[k] != shape:
            raise DrScaleError(f"{source}: {k} has shape {shape}, the model expects {own[k]}")
    return list(theirs)


def _load_partition(param, weights: HFWeights, name: str):
    """ZeRO-3 keeps elements [rank x n, (rank + 1) x n) of the flattened parameter on a rank
    (n its partition size, the last one padded)."""
    import torch.distributed as dist

    n = param.ds_tensor.numel()
    start = dist.get_rank(group=param.ds_process_group) * n
    end = min(start + n, param.ds_numel)
    if start < end:
        param.ds_tensor.data[:end - start].copy_(weights.read(name, start, end))
