"""The native decode stack (``csrc/decode_layers.cpp``: every layer of a step of
decodes in one call) against the op-by-op torch layers it replaces.

Greedy output of both paths against transformers is in ``test_exactness.py`` (which
runs each path); here one step of both paths over the same cache, with rows of
different lengths around block boundaries, grouped-query heads, never-written slots
full of NaN, packed GGUF (float32 and the fast mode's int4) and dense weights.
"""

from __future__ import annotations

import pytest
import torch

from tessera.workers.attention.metadata import AttentionMetadata
from tessera.workers.kv.kv_cache import allocate_kv_cache
from tessera.workers.model.llama import _UNBUILT
from tessera.workers.model.loader import fast_mode_available, load_model
from tessera.workers.quant.int4 import Q4Weight
from tessera.workers.quant.kernels import native_kernels
from tests.helpers import (
    DEFAULT_SHARE_ROWS,
    multi_row_requests,
    run_multi_row,
    save_random_llama,
    save_random_model,
)


@pytest.fixture(autouse=True)
def _native_extension():
    if native_kernels() is None:
        pytest.skip("the native extension could not be built here (warned at build)")


BLOCK_SIZE = 16
SEQ_LENS = [1, 15, 16, 17, 40, 33]


def decode_batch(
    num_blocks: int,
    seq_lens: list[int] = SEQ_LENS,
    chunks: list[tuple[int, int]] = (),
    linked: int = 0,
) -> AttentionMetadata:
    """Rows of ``seq_lens`` tokens, then causal chunks of (rows, seq_len) (each the last
    ``rows`` tokens of its sequence), each sequence on its own scattered blocks (never
    block 0..1); the last ``linked`` rows of ``seq_lens`` (lengths one apart) are one
    sequence's new tokens, each its own row on that sequence's blocks, as the engine
    runs a short prompt."""
    generator = torch.Generator().manual_seed(1)
    free = (torch.randperm(num_blocks - 2, generator=generator) + 2).tolist()
    lengths = [*seq_lens, *(n for _, n in chunks)]
    new_rows = [1] * len(seq_lens) + [rows for rows, _ in chunks]
    width = max(-(-n // BLOCK_SIZE) for n in lengths)
    tables, slots = [], []
    shared: list[int] = []  # the linked rows' sequence's blocks
    for index, (n, rows) in enumerate(zip(lengths, new_rows, strict=True)):
        if len(seq_lens) - linked <= index < len(seq_lens):
            shared = shared or [free.pop() for _ in range(-(-seq_lens[-1] // BLOCK_SIZE))]
            own = shared[: -(-n // BLOCK_SIZE)]
        else:
            own = [free.pop() for _ in range(-(-n // BLOCK_SIZE))]
        tables.append(own + [0] * (width - len(own)))
        slots += [own[i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE for i in range(n - rows, n)]
    starts = [0]
    for rows in new_rows:
        starts.append(starts[-1] + rows)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(lengths),
        block_tables=torch.tensor(tables),
        num_decodes=len(seq_lens),
        query_start_loc_list=starts,
        seq_lens_list=lengths,
    )


def one_step(
    loaded,
    native: bool,
    rows: torch.Tensor | None = None,
    seq_lens: list[int] = SEQ_LENS,
    chunks: list[tuple[int, int]] = (),
    linked: int = 0,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (of ``rows``, default all) and the cache after one step of decode rows of
    ``seq_lens`` tokens (the last ``linked`` one sequence's) and prompt ``chunks``
    (``decode_batch``) over a cache of random K/V (NaN in the blocks no row reads: with
    a ``window``, the blocks wholly before it too)."""
    model, config = loaded.model, loaded.config
    lengths = [*seq_lens, *(n for _, n in chunks)]
    num_blocks = 13 + sum(-(-n // BLOCK_SIZE) for n in lengths)  # 24 for SEQ_LENS
    dtype = loaded.kv_dtype  # float16 in the fast mode
    cache = allocate_kv_cache(config, num_blocks, BLOCK_SIZE, dtype, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    # bf16-representable values: every dtype's cache holds the same numbers
    cache.copy_(torch.randn(cache.shape, generator=generator).to(torch.bfloat16).to(dtype))
    meta = decode_batch(num_blocks, seq_lens, chunks, linked)
    used = set()
    starts = meta.query_start_loc_list
    for i, n in enumerate(lengths):
        first = max(0, n - (starts[i + 1] - starts[i]) - window + 1) if window else 0
        used.update(meta.block_tables[i, first // BLOCK_SIZE : -(-n // BLOCK_SIZE)].tolist())
    for block in range(num_blocks):
        if block not in used:
            cache[:, :, block] = float("nan")
    T = meta.query_start_loc_list[-1]
    ids = torch.tensor([(17 * i + 5) % config.vocab_size for i in range(T)])
    positions = torch.cat(
        [
            torch.arange(n - (end - start), n)
            for n, start, end in zip(
                lengths, meta.query_start_loc_list[:-1], meta.query_start_loc_list[1:], strict=True
            )
        ]
    )
    rows = torch.arange(T) if rows is None else rows
    logits = model(ids, positions, cache, meta, rows, native=native)
    return logits, cache


@pytest.fixture(scope="module")
def smollm2_fast(smollm2_path):
    return load_model(smollm2_path, "bfloat16")


@pytest.fixture(scope="module")
def odd_head_llama(tmp_path_factory, smollm2):
    """A tiny random Llama whose head_dim (24) has no register-resident attention
    kernel: the native stack's generic attention loop runs."""
    path = tmp_path_factory.mktemp("odd-head-llama")
    save_random_llama(path, smollm2.tokenizer, hidden_size=96, intermediate_size=128)
    return load_model(path, "float32")


@pytest.fixture(scope="module")
def wide_group_llama(tmp_path_factory, smollm2):
    """A tiny random Llama whose KV head serves 6 query heads: more than the register
    kernel takes at once (4), so its heads go in two sets over the same K/V."""
    path = tmp_path_factory.mktemp("wide-group-llama")
    save_random_llama(
        path, smollm2.tokenizer, hidden_size=96, num_attention_heads=6, num_key_value_heads=1
    )
    return load_model(path, "float32")


@pytest.fixture(scope="module")
def smollm2_auto(smollm2_path):
    """The fast mode: float32, the Q4 matrices through the bf16 kernel."""
    if not fast_mode_available():
        pytest.skip("the fast mode needs the AVX512_BF16 kernel; auto is float32 here")
    loaded = load_model(smollm2_path, "auto")
    assert loaded.precision == "fast"
    return loaded


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, smollm2):
    """A tiny random Qwen3: each q and k head RMS-normed (random weights) before RoPE,
    heads wider than hidden / heads."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.normal_(1.0, 0.5)
    path = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(path)
    smollm2.tokenizer.save_pretrained(path)
    return load_model(path, "float32")


@pytest.fixture(scope="module")
def phi3(tmp_path_factory, smollm2):
    """A tiny random Phi-3 whose RoPE turns the first half of each head only."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Phi3Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5},
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("phi3")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    smollm2.tokenizer.save_pretrained(path)
    loaded = load_model(path, "float32")
    assert loaded.config.rotary_dims == 8
    return loaded


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory, smollm2):
    """A tiny random Qwen2-MoE: sparse layers (6 experts, top 2, a gated shared expert)
    around a dense one, q/k/v biases."""
    path = tmp_path_factory.mktemp("qwen2-moe")
    model = save_random_model(
        path, smollm2.tokenizer, "Qwen2MoeConfig", num_hidden_layers=3, num_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        mlp_only_layers=[1], norm_topk_prob=False,
    )  # fmt: skip
    with torch.no_grad():  # clear routing: no near-ties between the experts' scores
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 1.0)
    model.save_pretrained(path)
    loaded = load_model(path, "float32")
    assert [layer.moe is not None for layer in loaded.model.layers] == [True, False, True]
    return loaded


@pytest.mark.parametrize(
    "which",
    ["smollm2", "tiny_llama", "odd_head_llama", "wide_group_llama", "qwen3", "phi3", "qwen2_moe"],
)
def test_native_float32_step_equals_the_op_by_op_step(request, which):
    """Packed GGUF (SmolLM2, head_dim 64, 3 query heads a KV head) and dense (tiny random
    Llamas, head_dim 16 with 2 or 6 query heads a KV head, and 24; a Qwen3 with its
    per-head q/k norms; a Phi-3 with partial rotary; a Qwen2-MoE's experts, shared
    expert and dense layer) float32 weights: the two paths differ only in the order of
    float sums."""
    loaded = request.getfixturevalue(which)
    if which == "tiny_llama":
        loaded = load_model(loaded[0], "float32")
    assert loaded.model.native_layers() is not None
    logits, cache = one_step(loaded, native=True)
    expected, expected_cache = one_step(loaded, native=False)
    # 30 layers over a random cache (peaky softmaxes) magnify the sums' rounding to ~2e-4
    assert (logits - expected).abs().max() <= 1e-3 * expected.abs().max()
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    assert torch.equal(cache.isnan(), expected_cache.isnan())  # NaN blocks never read
    torch.testing.assert_close(cache, expected_cache, rtol=0, atol=1e-3, equal_nan=True)


def test_native_step_does_not_depend_on_how_the_threads_split_the_rows(smollm2):
    """The decode attention's rows go in pieces of equal cost that the threads claim as
    they come free (``attend_all``, csrc/pieces.h), as the products' tiles do: one thread
    and two give the same logits and cache, bit for bit."""
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(one_step(smollm2, native=True))
    finally:
        torch.set_num_threads(threads)
    (logits1, cache1), (logits2, cache2) = results
    assert torch.equal(logits1, logits2)
    assert torch.equal(cache1.nan_to_num(), cache2.nan_to_num())


def loaded_in_shares(request, which: str):
    """The fixture ``which``, or a skip where its steps of decodes cannot run in shares of
    rows: every projection must take the tiled Q4 kernels (the exact mode's float32 one,
    AVX-512 or AVX2; the fast and bfloat16 modes' bf16 one, AVX512_BF16)."""
    native = native_kernels()
    if which == "smollm2" and not native.tiled_f32_available():
        pytest.skip("no AVX-512 or AVX2 kernel on this CPU: no exact step runs in shares of rows")
    if which != "smollm2" and not native.q4_bf16_available():
        pytest.skip("no AVX512_BF16 kernel on this CPU: no step runs in shares of rows")
    return request.getfixturevalue(which)


#: Two steps of 18 rows: 18 decodes; 8 decodes, then two prompt chunks (5 rows after 15
#: cached tokens, then a whole 5-token prompt).
STEPS_OF_18 = {
    "decodes": (SEQ_LENS * 3, []),
    "decodes-and-chunks": (SEQ_LENS[:4] * 2, [(5, 20), (5, 5)]),
}


@pytest.mark.parametrize("which", ["smollm2", "smollm2_fast", "smollm2_auto"])
@pytest.mark.parametrize("step", list(STEPS_OF_18))
@pytest.mark.parametrize(
    "rows", [None, [0, 5, 9, 9, 17], [17, 0]], ids=["every-row", "in-order", "out-of-order"]
)
def test_a_step_in_shares_of_rows_gives_the_numbers_of_one_over_every_row(
    request, which, step, rows
):
    """The Q4 kernels' steps of 18 rows on two threads: each thread runs a share of the
    decode rows through every layer alone (``use_row_shares``, csrc/decode_layers.cpp's
    ``run_in_shares``; a step's prompt chunks after them, ``run_split``), or the threads
    share each product: the logits of the rows asked for (in order: the shares' rows
    joined; out of order: one run) and the cache, bit for bit, in the exact, fast and
    bfloat16 modes. Only the shares fetch the next layer's K/V."""
    native = native_kernels()
    loaded = loaded_in_shares(request, which)
    seq_lens, chunks = STEPS_OF_18[step]
    picked = None if rows is None else torch.tensor(rows)
    amx = which != "smollm2" and native.amx_in_use()  # the bf16 AMX path fetches none
    threads = torch.get_num_threads()
    results = []
    try:
        torch.set_num_threads(2)
        for least in (DEFAULT_SHARE_ROWS, 0):
            assert native.use_row_shares(least) == least
            before = native.kv_prefetched_lines()
            results.append(
                one_step(loaded, native=True, rows=picked, seq_lens=seq_lens, chunks=chunks)
            )
            fetched = native.kv_prefetched_lines() - before
            in_shares = least > 0 and rows != [17, 0]
            assert (fetched > 0) == (in_shares and not amx), (least, fetched)
    finally:
        native.use_row_shares(DEFAULT_SHARE_ROWS)
        torch.set_num_threads(threads)
    (logits, cache), (expected, expected_cache) = results
    assert logits.shape == (18 if rows is None else len(rows), loaded.config.vocab_size)
    assert torch.equal(logits, expected)
    assert torch.equal(cache.nan_to_num(), expected_cache.nan_to_num())
    with pytest.raises(
        RuntimeError, match=r"use_row_shares: rows must be >= 0 \(0: never\), got -1"
    ):
        native.use_row_shares(-1)


@pytest.mark.parametrize("which", ["smollm2", "smollm2_fast", "smollm2_auto"])
@pytest.mark.parametrize("step", list(STEPS_OF_18))
@pytest.mark.parametrize("rows", [None, [0, 5, 9, 9, 17]], ids=["every-row", "in-order"])
def test_rows_handed_to_a_waiting_thread_give_the_numbers_of_one_run(request, which, step, rows):
    """A thread done with its share of a step of decodes takes the last half of the other
    thread's rows as that one starts its next layer (``run_in_shares``). With the second
    thread held until the first has claimed both shares (``hold_second_share``), the first
    hands it rows (``share_handovers`` counts them; a few tries, since the second may be
    off its core for the whole share), and the logits of the rows asked for and the
    cache are bit for bit those of the step with every product shared."""
    native = native_kernels()
    loaded = loaded_in_shares(request, which)
    seq_lens, chunks = STEPS_OF_18[step]
    picked = None if rows is None else torch.tensor(rows)
    threads = torch.get_num_threads()
    handed = []
    try:
        torch.set_num_threads(2)
        assert native.use_row_shares(0) == 0
        expected, expected_cache = one_step(
            loaded, native=True, rows=picked, seq_lens=seq_lens, chunks=chunks
        )
        native.use_row_shares(DEFAULT_SHARE_ROWS)
        assert native.hold_second_share(True) is True
        for _ in range(5):
            before = native.share_handovers()
            handed.append(
                one_step(loaded, native=True, rows=picked, seq_lens=seq_lens, chunks=chunks)
            )
            if native.share_handovers() > before:
                break
        else:
            pytest.fail("no share was handed over in 5 steps")
    finally:
        native.hold_second_share(False)
        native.use_row_shares(DEFAULT_SHARE_ROWS)
        torch.set_num_threads(threads)
    for logits, cache in handed:
        assert torch.equal(logits, expected)
        assert torch.equal(cache.nan_to_num(), expected_cache.nan_to_num())


@pytest.mark.parametrize("which", ["smollm2", "smollm2_fast", "smollm2_auto"])
def test_no_share_is_cut_between_rows_that_read_each_others_kv(request, which):
    """A short prompt's 9 tokens as decode rows (each reads the K/V the ones before it
    write in the same layer), one share of a step of 18: that share is never handed over
    in part, even with the second thread held (``share_handovers`` does not move), and
    the logits and the cache are bit for bit the step's with every product shared."""
    native = native_kernels()
    loaded = loaded_in_shares(request, which)
    seq_lens = SEQ_LENS + SEQ_LENS[:3] + list(range(16, 25))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert native.use_row_shares(0) == 0
        expected, expected_cache = one_step(loaded, native=True, seq_lens=seq_lens, linked=9)
        native.use_row_shares(DEFAULT_SHARE_ROWS)
        native.hold_second_share(True)
        before, lines = native.share_handovers(), native.kv_prefetched_lines()
        logits, cache = one_step(loaded, native=True, seq_lens=seq_lens, linked=9)
        handovers = native.share_handovers() - before
        fetched = native.kv_prefetched_lines() - lines
    finally:
        native.hold_second_share(False)
        native.use_row_shares(DEFAULT_SHARE_ROWS)
        torch.set_num_threads(threads)
    # the step ran in shares (only shares fetch K/V ahead; the bf16 AMX path fetches none)
    assert fetched > 0 or (which != "smollm2" and native.amx_in_use())
    assert handovers == 0
    assert torch.equal(logits, expected)
    assert torch.equal(cache.nan_to_num(), expected_cache.nan_to_num())


@pytest.mark.parametrize("which", ["smollm2", "smollm2_fast", "smollm2_auto"])
@pytest.mark.parametrize("seq_lens", [SEQ_LENS * 3, SEQ_LENS[:4] * 2], ids=["18-rows", "8-rows"])
def test_a_share_fetches_the_next_layers_kv_and_the_numbers_stay(request, which, seq_lens):
    """A share of a step of 18 or 8 decodes on two threads queues each next layer's K/V
    blocks of its rows for the Q4 kernel (float32 or bf16) to fetch while it computes
    (csrc/side_prefetch.h): every line of them is asked for (with ``use_kv_prefetch``
    on, none with it off), and the logits and the cache are bit for bit those of the step
    without. 9 rows a share go through the exact kernel's buffered loop, 4 through its
    direct one."""
    native = native_kernels()
    loaded = loaded_in_shares(request, which)
    config = loaded.config
    kv_size = config.num_kv_heads * config.head_dim
    cache_bytes = loaded.kv_dtype.itemsize  # float32 (exact), float16 (fast) or bfloat16
    blocks = sum((n + BLOCK_SIZE - 1) // BLOCK_SIZE for n in seq_lens)
    # every layer but the first: each row's K and V blocks, whole
    expected_lines = (config.num_layers - 1) * blocks * 2 * BLOCK_SIZE * kv_size * cache_bytes // 64
    threads = torch.get_num_threads()
    results, asked = [], []
    try:
        torch.set_num_threads(2)
        # a share handed to the other thread leaves lines of its rows unasked
        native.use_share_handover(False)
        for wanted in (True, False):
            assert native.use_kv_prefetch(wanted) is wanted
            before = native.kv_prefetched_lines()
            results.append(one_step(loaded, native=True, seq_lens=seq_lens))
            asked.append(native.kv_prefetched_lines() - before)
    finally:
        native.use_kv_prefetch(True)
        native.use_share_handover(True)
        torch.set_num_threads(threads)
    # the bf16 kernel's AMX path (a CPU with AMX) computes without fetching any
    amx = which != "smollm2" and native.amx_in_use()
    assert asked == [0 if amx else expected_lines, 0]
    (logits, cache), (expected, expected_cache) = results
    assert torch.equal(logits, expected)
    assert torch.equal(cache.nan_to_num(), expected_cache.nan_to_num())


@pytest.mark.parametrize("which", ["smollm2", "smollm2_auto"])
@pytest.mark.parametrize("native", [True, False])
def test_a_step_gives_the_logits_of_the_rows_asked_for(request, which, native):
    """The final norm takes the rows whose logits are wanted, in their order, and the last
    layer goes on past its attention with those rows only (the others need only their
    K/V): bit for bit the logits those rows have when every row goes on, and the same
    cache, on both paths and in the exact and fast modes."""
    loaded = request.getfixturevalue(which)
    every, every_cache = one_step(loaded, native=native)
    some, some_cache = one_step(loaded, native=native, rows=torch.tensor([4, 0, 4]))
    assert torch.equal(some, every[[4, 0, 4]])
    assert torch.equal(some_cache.nan_to_num(), every_cache.nan_to_num())
    # a step none of whose rows wants logits (a long prompt's middle chunk) still writes
    # every row's K/V
    none, none_cache = one_step(loaded, native=native, rows=torch.tensor([], dtype=torch.int64))
    assert none.shape == (0, loaded.config.vocab_size)
    assert torch.equal(none_cache.nan_to_num(), every_cache.nan_to_num())


def test_exact_rows_past_the_tiled_kernels_limit_take_the_dense_gemm_on_both_paths(
    smollm2, monkeypatch
):
    """A step of more rows than ``Linear.int4_rows`` (``exact_row_limit``: a long prompt's)
    multiplies the same float32 weights through torch's GEMM, in the native stack
    (``csrc/decode_layers.cpp``'s Linear) as op by op: the logits move by the order of
    float32 sums only."""
    model = smollm2.model
    linears = [
        linear
        for layer in model.layers
        for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    ]
    if not all(isinstance(x.int4, Q4Weight) and x.int4.exact for x in linears):
        pytest.skip("no AVX-512 or AVX2 on this CPU: the exact mode keeps gguf_mm's layout")
    tiled, _ = one_step(smollm2, native=True)
    for linear in linears:
        monkeypatch.setattr(linear, "int4_rows", 2)  # the step has 6 rows
    monkeypatch.setattr(model, "_native_layers", _UNBUILT)  # the stack rebuilt with it
    for native in (True, False):
        logits, _ = one_step(smollm2, native=native)
        assert not torch.equal(logits, tiled)  # another order of sums ran
        assert (logits - tiled).abs().max() <= 1e-3 * tiled.abs().max()
        assert torch.equal(logits.argmax(-1), tiled.argmax(-1))


@pytest.mark.parametrize("which", ["smollm2_fast", "smollm2_auto"])
def test_native_reduced_precision_step_is_as_close_to_float32_as_the_op_by_op_one(
    request, smollm2, which
):
    """The bfloat16 mode (bf16 activations and KV, Q4 weights through the bf16 kernel)
    rounds where the op-by-op path rounds, except inside attention; the fast mode
    (float32, bf16 inputs to the GGUF matmuls) rounds the same matmul inputs on both paths,
    but a last-bit difference of the float32 sums before a rounding moves it a whole bf16
    step. Over a cache of random K/V (peaky softmaxes, which magnify any rounding) each
    native step stays about as close to the exact float32 step as its op-by-op step. Each
    error is one sample of bf16 rounding noise, magnified: measured mean |error| native /
    op-by-op 0.65 / 1.09 (bfloat16; 0.54 / 0.73 with torch's int4), 0.30 / 0.30 (fast)."""
    loaded = request.getfixturevalue(which)
    exact, _ = one_step(smollm2, native=False)
    native, cache = one_step(loaded, native=True)
    eager, eager_cache = one_step(loaded, native=False)
    native_error = (native - exact).abs().mean()
    eager_error = (eager - exact).abs().mean()
    assert native_error <= 1.5 * eager_error, (native_error, eager_error)
    assert torch.equal(cache.isnan(), eager_cache.isnan())


def test_native_decode_gives_the_op_by_op_tokens_for_every_kind_of_row(make_engine):
    """Speculative verification (prompt lookup, and a self-speculative draft whose own
    decode steps run through its own 8-layer stack), parallel tokens and n > 1 forks:
    the same tokens, parallel sets and samples on both paths."""
    requests = multi_row_requests()
    native, op_by_op = (
        make_engine(draft_model="target:8", native_decode=native) for native in (True, False)
    )
    assert native.runner.native_decode and native.speculator.draft.runner.native_decode
    assert run_multi_row(native, requests) == run_multi_row(op_by_op, requests)


def test_native_step_refuses_a_block_outside_the_cache(smollm2):
    model, config = smollm2.model, smollm2.config
    cache = allocate_kv_cache(config, 4, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    hidden = torch.zeros(1, config.hidden_size)
    cos = torch.ones(1, config.head_dim)
    with pytest.raises(RuntimeError, match="DecodeLayers: block 9 of row 0 is outside the cache"):
        model.native_layers().forward(
            hidden, cos, cos, torch.tensor([3]), torch.tensor([20]), torch.tensor([[0, 9]]), cache
        )
    narrow = f"DecodeLayers: hidden has 7 features, the layers take {config.hidden_size}"
    with pytest.raises(RuntimeError, match=narrow):
        model.native_layers().forward(
            torch.zeros(1, 7),
            cos,
            cos,
            torch.tensor([3]),
            torch.tensor([20]),
            torch.tensor([[0, 1]]),
            cache,
        )
    step = (hidden, cos, cos, torch.tensor([3]), torch.tensor([5]), torch.tensor([[0, 1]]), cache)
    norm = model.norm.weight
    with pytest.raises(RuntimeError, match="DecodeLayers: row 1 is not one of the 1"):
        model.native_layers().forward(*step, norm, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="rows must be int64 \\[S\\], with the final norm"):
        model.native_layers().forward(*step, None, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="rows must be int64 \\[S\\], with the final norm"):
        model.native_layers().forward(*step, norm, None)
    too_long = "DecodeLayers: seq_len 40 of row 0 does not fit 2 blocks"
    with pytest.raises(RuntimeError, match=too_long):
        model.native_layers().forward(
            hidden, cos, cos, torch.tensor([3]), torch.tensor([40]), torch.tensor([[0, 1]]), cache
        )
    # three rows: one decode, then a prompt chunk of two
    rows3 = (torch.zeros(3, config.hidden_size), torch.ones(3, config.head_dim))
    prompt_step = (*rows3, rows3[1], torch.tensor([3, 4, 5]), *step[4:], None, None)
    with pytest.raises(RuntimeError, match="DecodeLayers: 2 rows are neither decodes nor prompts"):
        model.native_layers().forward(*prompt_step)
    cases = [
        ([[1, 1, 6]], "DecodeLayers: the decodes and prompts cover 2 rows of 3"),
        ([[2, 2, 6]], r"DecodeLayers: prompt 0 starts at row 2, not at row 1 \(after the"),
        ([[1, 2, 1]], r"DecodeLayers: prompt 0 has 2 rows, not 1 \.\. its seq_len 1"),
        ([[1, 2, 33]], "DecodeLayers: seq_len 33 of prompt 0 does not fit 2 blocks"),
    ]  # fmt: skip
    for prompts, message in cases:
        with pytest.raises(RuntimeError, match=message):
            model.native_layers().forward(
                *prompt_step, torch.tensor(prompts), torch.tensor([[2, 3]])
            )
    with pytest.raises(RuntimeError, match="DecodeLayers: block 9 of prompt 0 is outside"):
        model.native_layers().forward(
            *prompt_step, torch.tensor([[1, 2, 20]]), torch.tensor([[2, 9]])
        )


PROSE = (
    "The old lighthouse stood on a rock at the edge of the bay. Every night its keeper "
    "climbed the stairs, trimmed the wick and watched the ships pass in the dark, "
    "counting them in a book that nobody ever read."
)


def _prompt_logprobs(loaded, native: bool, calls: list[tuple[bool, int]]) -> torch.Tensor:
    """PROSE's prompt logprobs, computed in a step that also decodes another request;
    ``calls`` gets each forward's ``native`` and its number of whole (causal) chunks."""
    from tessera.workers.api import SamplingParams
    from tessera.workers.config import EngineConfig
    from tessera.workers.engine.engine import Engine
    from tests.helpers import run_engine

    dtype = "float32" if loaded.model.norm.weight.dtype == torch.float32 else "bfloat16"
    engine = Engine(
        EngineConfig(dtype=dtype, num_kv_blocks=64, native_decode=native), loaded=loaded
    )
    model = engine.runner.model
    forward = model.forward

    def spy(*args, native: bool = False, **kwargs):
        meta = args[3]
        calls.append((native, meta.num_seqs - meta.num_decodes))
        return forward(*args, native=native, **kwargs)

    model.forward = spy
    try:
        engine.add_request("other", "Hello", SamplingParams(max_tokens=8, ignore_eos=True))
        engine.step()  # its prompt; from the next step on it decodes
        engine.add_request("prose", PROSE, SamplingParams(max_tokens=1, prompt_logprobs=0))
        out = run_engine(engine)["prose"]
    finally:
        del model.forward
    return torch.tensor([p.logprob for p in out[0].prompt_logprobs[1:]])


def test_native_prompt_rows_are_as_close_to_float32_as_the_op_by_op_ones(smollm2, smollm2_fast):
    """A step mixing a prompt chunk with a decode runs natively. In bf16 the short chunk
    goes as decode rows, each reading its context from the cache: the prompt's logprobs
    stay as close to the float32 ones as the op-by-op step's. In float32 it stays whole,
    its attention torch's flash kernel as op by op: only the order of float32 sums in the
    norms differs."""
    calls: list[tuple[bool, int]] = []
    exact = _prompt_logprobs(smollm2, native=False, calls=[])
    native = _prompt_logprobs(smollm2_fast, native=True, calls=calls)
    assert calls and all(native and not whole for native, whole in calls), calls
    eager = _prompt_logprobs(smollm2_fast, native=False, calls=[])
    native_error = (native - exact).abs().mean()
    eager_error = (eager - exact).abs().mean()
    assert 0 < native_error <= 1.25 * eager_error, (native_error, eager_error)

    calls.clear()
    native32 = _prompt_logprobs(smollm2, native=True, calls=calls)
    assert all(native for native, _ in calls) and (True, 1) in calls, calls
    assert not torch.equal(native32, exact)
    torch.testing.assert_close(native32, exact, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def windowed_mistral(tmp_path_factory, smollm2):
    """A tiny random Mistral whose layers attend to their last 10 positions: shorter
    than most of the step's rows and chunks, and not a multiple of the block size."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        sliding_window=10, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("windowed-mistral")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    smollm2.tokenizer.save_pretrained(path)
    return load_model(path, "float32")


def test_native_windowed_step_equals_the_op_by_op_step(windowed_mistral):
    """A sliding window in the native stack: decode rows attend from their window's
    first index (inside a block or on its edge), causal chunks through the window's
    mask, as the op-by-op layers do. The blocks wholly before every window are filled
    with NaN: neither path reads them."""
    loaded = windowed_mistral
    assert loaded.model.native_layers() is not None
    chunks = [(5, 40), (12, 30), (3, 9)]
    logits, cache = one_step(loaded, native=True, chunks=chunks, window=10)
    expected, expected_cache = one_step(loaded, native=False, chunks=chunks, window=10)
    assert not logits.isnan().any()
    assert (logits - expected).abs().max() <= 1e-3 * expected.abs().max()
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(cache, expected_cache, rtol=0, atol=1e-3, equal_nan=True)
