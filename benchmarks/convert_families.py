"""Every family through llama.cpp's own converter, read back by Tessera's GGUF loader.

For each family a tiny random model is built with transformers (weights scaled so that
its logits are peaked: a random model's are nearly flat and near-ties hide mistakes),
saved as a Hugging Face directory with a tokenizer the converter accepts, and converted
by llama.cpp's ``convert_hf_to_gguf.py`` (the real one, run as a subprocess with its own
``gguf-py``). ``--outtype q4_0`` re-quantises the converter's F32 file with ``gguf-py``:
every key copied, every float tensor of 2 or more dimensions whose rows are a multiple
of 32 wide stored as Q4_0, norms and 1-D tensors left F32.

Unless ``--no-check``, each file is loaded with ``load_model(path, "float32")`` and its
next-token logits after a prompt several sliding windows long (and, for LongRoPE, one
past the original context) are compared:

- a float file (f32, f16, bf16) with transformers running the directory it came from;
- a quantised file (q8_0, q4_0), loaded with its matrices packed, with Tessera reading
  its dequantised F32 twin (same keys, same values), whose float path the F32 file
  checks; the difference from transformers (the quantisation error) is printed beside.

A file passes below ``TOLERANCE``. Where the converter drops a setting a file cannot
carry (the Llama converter writes no sliding window for Mistral), the reference is
transformers with the value the file implies (``Family.dropped``: what llama.cpp runs),
and the difference from the model as built is printed with the family's note.

Tokenizers: SmolLM2's (``load_tokenizer(None)``, 49,152 tokens, a pre-tokenizer hash
the converter knows) for the byte-level BPE families; for those whose converter reads a
SentencePiece ``tokenizer.model`` (Gemma 2, Gemma 3, Phi-3) a 512-piece model trained
here on the repository's README and docs. The model's vocabulary is the tokenizer's.

The converter wants ``sentencepiece`` and its pinned transformers 4.57.6 (under
transformers 5 a Qwen2 directory's tokenizer loads as ``Qwen2Tokenizer``, whose hash
the converter does not know); this script wants the project's packages. Setting both
up from the llama-cpp-python sdist, which vendors llama.cpp's tree::

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/sdist
    tar xzf /tmp/sdist/llama_cpp_python-0.3.36.tar.gz -C /tmp/sdist
    for v in convvenv convvenv4; do
        python3 -m venv /tmp/$v
        echo "import site; site.addsitedir('$PWD/.venv/lib/python3.11/site-packages')" \\
            > /tmp/$v/lib/python3.11/site-packages/tessera_venv.pth
    done
    /tmp/convvenv/bin/pip install sentencepiece
    /tmp/convvenv4/bin/pip install sentencepiece transformers==4.57.6

Then::

    /tmp/convvenv/bin/python benchmarks/convert_families.py \\
        --llama-cpp /tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        --converter-python /tmp/convvenv4/bin/python \\
        --out /tmp/families --outtype f32 q8_0 q4_0

writes ``OUT/hf/<family>/``, ``OUT/<family>-<type>.gguf`` (with the converter's log
beside it), one line per family and type (converted, loaded, max |logit difference|,
OK or FAIL) and ``OUT/results.json``; it exits 1 if any file failed. Arguments for the
converter pass through: ``--converter-arg=--fuse-qkv``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

#: Converter output types run by the converter itself; ``q4_0`` is re-quantised here.
CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")
OUTTYPES = (*CONVERTER_TYPES, "q4_0")
#: A file's logits must agree this closely with its reference's.
TOLERANCE = 1e-3
#: The prompt's length: several sliding windows (``WINDOW``) long.
PROMPT_LEN = 40
WINDOW = 8
#: The SentencePiece vocabulary trained for the families that need ``tokenizer.model``.
SP_VOCAB = 512
#: A block of Q4_0 holds this many weights (a tensor's rows must be a multiple of it).
Q4_0_BLOCK = 32

COMMON = dict(
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


@dataclass(frozen=True, slots=True)
class Family:
    """One tiny model: its transformers config class, the fields that differ from
    ``COMMON``, the tokenizer it is saved with (``bpe``: SmolLM2's, ``sentencepiece``:
    a ``tokenizer.model``), the ``tokenizer_class`` its tokenizer_config.json names
    (the Phi-3 converter picks its vocabulary reader by it), the prompt lengths checked
    and what the file cannot carry."""

    config_class: str
    fields: dict[str, Any]
    tokenizer: str = "bpe"
    tokenizer_class: str | None = None
    prompt_lens: tuple[int, ...] = (PROMPT_LEN,)
    #: Config fields the converter does not write, with the value the file implies
    #: (llama.cpp runs it so): the reference the file must match has them.
    dropped: dict[str, Any] = field(default_factory=dict)
    note: str = ""


_PHI3_ROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.75,
    # one factor per rotated pair: 0.75 * 32 / 2
    "short_factor": [1.0 + 0.1 * i for i in range(12)],
    "long_factor": [2.0 + 0.5 * i for i in range(12)],
}
FAMILIES: dict[str, Family] = {
    "llama": Family(
        "LlamaConfig",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "mistral": Family(
        "MistralConfig",
        dict(sliding_window=WINDOW),
        dropped=dict(sliding_window=None),
        note="the Llama converter writes no sliding window",
    ),
    "qwen2": Family(
        "Qwen2Config",
        dict(
            max_position_embeddings=64,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "qwen3": Family("Qwen3Config", dict(head_dim=48)),
    "gemma2": Family(
        "Gemma2Config",
        dict(
            num_hidden_layers=4,
            head_dim=48,
            # llama.cpp's Gemma query scale: head_dim ** -0.5 below the 27B shapes
            query_pre_attn_scalar=48,
            sliding_window=WINDOW,
            attn_logit_softcapping=20.0,
            final_logit_softcapping=15.0,
            tie_word_embeddings=True,
        ),
        tokenizer="sentencepiece",
    ),
    "gemma3_text": Family(
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=6,  # five local layers, then a global one
            head_dim=48,
            query_pre_attn_scalar=48,
            sliding_window=WINDOW,
            tie_word_embeddings=True,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
        tokenizer="sentencepiece",
    ),
    "phi3": Family(
        "Phi3Config",
        dict(
            sliding_window=WINDOW,
            original_max_position_embeddings=64,
            rope_parameters=_PHI3_ROPE,
        ),
        tokenizer="sentencepiece",
        tokenizer_class="LlamaTokenizer",
        prompt_lens=(PROMPT_LEN, 80),  # short factors, then past the original context
    ),
    "phi4_mini": Family(
        "Phi3Config",
        dict(
            sliding_window=None,
            tie_word_embeddings=True,
            original_max_position_embeddings=64,
            rope_parameters=_PHI3_ROPE,
        ),
        tokenizer_class="GPT2Tokenizer",
        prompt_lens=(PROMPT_LEN, 80),
    ),
    "mixtral": Family(
        "MixtralConfig",
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
    ),
    "qwen2_moe": Family(
        "Qwen2MoeConfig",
        dict(
            num_hidden_layers=3,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
        ),
        # (the converter maps no dense layer's MLP in a Qwen2-MoE: mlp_only_layers fails)
    ),
    "qwen3_moe": Family(
        "Qwen3MoeConfig",
        dict(
            head_dim=48,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        ),
    ),
}


@dataclass(slots=True)
class Result:
    """One file. ``diff``: max |logit difference| per prompt length against the
    reference it must match (a float file: transformers running the model as the file
    carries it; a quantised one: Tessera reading the file's dequantised F32 twin, whose
    float path the float file checks); ``diff_transformers``: a quantised file against
    transformers (its quantisation error, for information); ``diff_as_built``: against
    the model before the converter dropped a setting."""

    family: str
    outtype: str
    converted: bool = False
    loaded: bool = False
    diff: dict[int, float] = field(default_factory=dict)
    diff_transformers: dict[int, float] = field(default_factory=dict)
    diff_as_built: dict[int, float] = field(default_factory=dict)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.loaded and bool(self.diff) and max(self.diff.values()) < TOLERANCE

    def line(self, note: str) -> str:
        def text(diffs: dict[int, float]) -> str:
            return ", ".join(f"{n}: {d:.1e}" for n, d in diffs.items())

        parts = [
            f"{self.family:12} {self.outtype:5}",
            f"converted={'yes' if self.converted else 'NO '}",
            f"loaded={'yes' if self.loaded else 'NO '}",
            f"max|diff| {text(self.diff) or '-'}",
            "OK" if self.ok else "FAIL",
        ]
        if self.diff_transformers:
            parts.append(f"(vs transformers {text(self.diff_transformers)})")
        if self.diff_as_built:
            parts.append(f"(as built {text(self.diff_as_built)}: {note})")
        if self.error:
            parts.append(f"error: {self.error}")
        return "  ".join(parts)


def train_sentencepiece(out: Path) -> Path:
    """A ``SP_VOCAB``-piece BPE SentencePiece model trained on the repository's prose."""
    import sentencepiece as spm

    model = out / "sp.model"
    if model.exists():
        return model
    root = Path(__file__).resolve().parents[1]
    text = out / "sp_corpus.txt"
    sources = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    text.write_text("\n".join(p.read_text(encoding="utf-8") for p in sources), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(out / "sp"),
        vocab_size=SP_VOCAB,
        model_type="bpe",
        character_coverage=1.0,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        minloglevel=2,
    )
    return model


def save_tokenizer(family: Family, path: Path, out: Path) -> int:
    """Save the family's tokenizer files at ``path``; its vocabulary size."""
    if family.tokenizer == "sentencepiece":
        model = train_sentencepiece(out)
        (path / "tokenizer.model").write_bytes(model.read_bytes())
        config = {
            "tokenizer_class": family.tokenizer_class or "LlamaTokenizer",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "pad_token": "<pad>",
        }
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        return SP_VOCAB
    from tessera.workers.model.loader import load_tokenizer

    tokenizer = load_tokenizer(None)  # SmolLM2's
    tokenizer.save_pretrained(path)
    # (transformers 5 saves its own class name, which the converter's pinned 4.x lacks)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = family.tokenizer_class or "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2))
    return len(tokenizer)


def build(name: str, path: Path, out: Path) -> torch.nn.Module:
    """Family ``name``'s tiny random model, saved with its tokenizer at ``path``."""
    import transformers

    family = FAMILIES[name]
    path.mkdir(parents=True, exist_ok=True)
    vocab = save_tokenizer(family, path, out)
    ids = dict(bos_token_id=2, eos_token_id=1, pad_token_id=0)
    if family.tokenizer == "bpe":
        ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2)  # SmolLM2's
    config_class = getattr(transformers, family.config_class)
    config = config_class(**{**COMMON, **ids, "vocab_size": vocab, **family.fields})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.normal_(0.5, 0.5)
            elif param_name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                param.normal_(0.0, 1.0)  # routers: no near-tie expert choices
            else:
                param.mul_(4.0)
    model.save_pretrained(path)
    return model


@dataclass(frozen=True, slots=True)
class Converter:
    """llama.cpp's ``convert_hf_to_gguf.py`` in ``llama_cpp``, run by ``python`` with
    its own ``gguf-py`` and ``extra_args`` (e.g. ``--fuse-qkv``)."""

    python: str
    llama_cpp: Path
    extra_args: tuple[str, ...] = ()

    def run(self, hf_dir: Path, outtype: str, outfile: Path) -> str | None:
        """Convert; None, or the tail of the converter's log where it failed (the whole
        log is written beside ``outfile``)."""
        env = {**os.environ, "PYTHONPATH": str(self.llama_cpp / "gguf-py")}
        script = str(self.llama_cpp / "convert_hf_to_gguf.py")
        command = [self.python, script, str(hf_dir), "--outtype", outtype]
        command += ["--outfile", str(outfile), *self.extra_args]
        done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=self.llama_cpp)
        log = done.stdout + done.stderr
        outfile.with_suffix(".log").write_text(log)
        return "\n".join(log.strip().splitlines()[-5:]) if done.returncode else None


def rewrite_gguf(source: Path, target: Path, kind: Any = None) -> None:
    """Copy ``source`` key for key with every tensor dequantised to F32, or with ``kind``
    (a ``GGMLQuantizationType``) every 2-D-or-more float tensor whose rows are a multiple
    of ``Q4_0_BLOCK`` wide quantised to it (norms and 1-D tensors stay F32)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize, quantize

    reader = GGUFReader(source)
    writer = GGUFWriter(target, reader.fields["general.architecture"].contents())
    for key, item in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the header, and the key GGUFWriter wrote itself
        sub_type = item.types[-1] if item.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, item.contents(), item.types[0], sub_type=sub_type)
    floats = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))  # numpy order: rows last
        data = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        data = data.reshape(shape)
        if (
            kind is not None
            and tensor.tensor_type in floats
            and len(shape) >= 2
            and not tensor.name.endswith("norm.weight")
            and shape[-1] % Q4_0_BLOCK == 0
        ):
            writer.add_tensor(tensor.name, quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def prefill_logits(loaded: Any, prompt: list[int], block_size: int = 16) -> torch.Tensor:
    """Tessera's float32 next-token logits after prefilling ``prompt`` in one step
    through the paged KV cache (the model layer alone, as ``tests/helpers.py`` does)."""
    from tessera.workers.api import Request
    from tessera.workers.engine.model_runner import ModelRunner
    from tessera.workers.engine.sequence import Sequence
    from tessera.workers.kv.kv_cache import allocate_kv_cache
    from tessera.workers.kv.manager import KVCacheManager

    num_blocks = -(-len(prompt) // block_size)
    kv = KVCacheManager(num_blocks, block_size)
    cache = allocate_kv_cache(
        loaded.config, num_blocks, block_size, torch.float32, torch.device("cpu")
    )
    runner = ModelRunner(loaded.model, kv, cache)
    seq = Sequence(
        Request("s", tuple(prompt)),
        seed=0,
        token_ids=list(prompt),
        detokenizer=None,
        stop_matcher=None,
    )
    assert kv.allocate("s", len(prompt))
    return runner.execute([seq.chunk(len(prompt))])[0]


def prompt_ids(vocab: int, length: int) -> list[int]:
    """``length`` fixed pseudo-random ids past the special ones (0-3)."""
    generator = torch.Generator().manual_seed(length)
    return torch.randint(4, vocab, (length,), generator=generator).tolist()


def transformers_diff(model: torch.nn.Module, prompt: list[int], ours: torch.Tensor) -> float:
    """max |``ours`` - transformers' next-token logits after ``prompt``|."""
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0, -1].float()
    return float((ours - expected).abs().max())


def load(result: Result, path: Path) -> Any:
    """``load_model(path, "float32")``, or None with the error in ``result``; where only
    the file's tokenizer fails, the weights are loaded with SmolLM2's to check them."""
    from tessera.workers.model.loader import load_model, load_tokenizer

    try:
        return load_model(path, "float32")
    except Exception as error:  # noqa: BLE001 - recorded in the report
        result.error = f"load_model: {type(error).__name__}: {error}"
        if "tokenizer" not in f"{type(error).__name__} {error}".lower():
            return None
    return load_model(path, "float32", tokenizer=load_tokenizer(None))


def check(
    result: Result,
    path: Path,
    family: Family,
    reference: torch.nn.Module,
    as_built: torch.nn.Module | None,
    twin: Path | None,
) -> None:
    """Load ``path`` as Tessera does and compare its logits: a float file with
    ``reference``'s (and ``as_built``'s), a quantised one with Tessera's on ``twin``."""
    loaded = load(result, path)
    if loaded is None:
        return
    result.loaded = True
    twin_model = None if twin is None else load(result, twin)
    if twin is not None and twin_model is None:
        return
    vocab = reference.config.vocab_size
    for length in family.prompt_lens:
        prompt = prompt_ids(vocab, length)
        ours = prefill_logits(loaded, prompt).float()

        if twin_model is None:
            result.diff[length] = transformers_diff(reference, prompt, ours)
        else:
            expected = prefill_logits(twin_model, prompt).float()
            result.diff[length] = float((ours - expected).abs().max())
            result.diff_transformers[length] = transformers_diff(reference, prompt, ours)
        if as_built is not None:
            result.diff_as_built[length] = transformers_diff(as_built, prompt, ours)


def run_family(name: str, args: argparse.Namespace) -> list[Result]:
    """Build, convert (each of ``args.outtype``) and check one family."""
    import transformers
    from gguf import GGMLQuantizationType

    family = FAMILIES[name]
    hf_dir = args.out / "hf" / name
    reference = as_built = build(name, hf_dir, args.out)
    if family.dropped:
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=torch.float32, **family.dropped
        ).eval()
    else:
        as_built = None
    converter = Converter(args.python, args.llama_cpp, tuple(args.converter_arg))
    outtypes = sorted(args.outtype, key=OUTTYPES.index)  # F32 before its Q4_0 copy
    results = []
    for outtype in outtypes:
        result = Result(name, outtype)
        results.append(result)
        outfile = args.out / f"{name}-{outtype}.gguf"
        outfile.unlink(missing_ok=True)
        if outtype == "q4_0":  # the converter's F32 file (of this run), re-quantised
            source = args.out / f"{name}-f32.gguf"
            if "f32" not in args.outtype:
                result.error = converter.run(hf_dir, "f32", source)
            if result.error is None and source.exists():
                rewrite_gguf(source, outfile, GGMLQuantizationType.Q4_0)
            elif result.error is None:
                result.error = "no F32 file to re-quantise (its conversion failed)"
        else:
            result.error = converter.run(hf_dir, outtype, outfile)
        if result.error is not None:
            continue
        result.converted = True
        if args.no_check:
            continue
        twin = None
        if outtype not in ("f32", "f16", "bf16"):
            twin = outfile.with_name(f"{outfile.stem}-dequantized.gguf")
            rewrite_gguf(outfile, twin)
        check(result, outfile, family, reference, as_built, twin)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--llama-cpp", type=Path, required=True, help="llama.cpp's tree (the converter's)"
    )
    parser.add_argument(
        "--converter-python",
        dest="python",
        default=sys.executable,
        help="the Python that runs the converter (default: this one)",
    )
    parser.add_argument(
        "--converter-arg",
        action="append",
        default=[],
        help="an argument passed on to the converter (repeat for more): --converter-arg=--fuse-qkv",
    )
    parser.add_argument("--out", type=Path, default=Path("/tmp/families"))
    parser.add_argument("--outtype", nargs="+", choices=OUTTYPES, default=["f32"])
    parser.add_argument("--family", nargs="+", choices=sorted(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--no-check", action="store_true", help="convert only")
    args = parser.parse_args()
    if not (args.llama_cpp / "convert_hf_to_gguf.py").is_file():
        parser.error(f"--llama-cpp: no convert_hf_to_gguf.py in {args.llama_cpp}")
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    results = []
    for name in args.family:
        for result in run_family(name, args):
            results.append(result)
            print(result.line(FAMILIES[name].note), flush=True)
    report = [
        {
            "family": r.family,
            "outtype": r.outtype,
            "converted": r.converted,
            "loaded": r.loaded,
            "ok": r.ok,
            "max_abs_diff": r.diff,
            "diff_transformers": r.diff_transformers,
            "diff_as_built": r.diff_as_built,
            "error": r.error,
        }
        for r in results
    ]
    (args.out / "results.json").write_text(json.dumps(report, indent=2))
    failed = [f"{r.family} {r.outtype}" for r in results if not r.ok and not args.no_check]
    print(
        f"{len(results) - len(failed)} passed, {len(failed)} failed"
        + (f": {', '.join(failed)}" if failed else "")
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
