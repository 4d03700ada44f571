"""The shared policy without a broker: tokenizer, model, checkpoints, sampling, backends, warm-start."""
from __future__ import annotations

import asyncio
import json
import re

import pytest
import torch

from crucible.services.generator.batcher import Batcher, LagBound
from crucible.ml.policy.backends import create_backend
from crucible.ml.policy.checkpoint import fresh_policy, load_checkpoint, save_checkpoint
from crucible.ml.policy import model as policy_model
from crucible.ml.policy.model import PolicyConfig, causal_mask, sequence_logprobs
from crucible.ml.policy.sampling import SamplingParams, sample
from crucible.ml.policy.sft import warm_start
from crucible.ml.policy.tokenizer import EOS_ID, ByteTokenizer

TEXTS = ["", "plain ascii 123", "héllo wörld — ∑ 漢字 🙂", "tabs\tand\nnewlines  "]


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_id and tok.decode(ids) == text


def test_checkpoint_loads_in_transformers_with_identical_logits_and_ids(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = fresh_policy(3)
    folder = save_checkpoint(model, tmp_path / "ckpt", {"version": 4})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary folders left behind
    hf_tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    hf = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    tok = ByteTokenizer()
    for text in TEXTS[1:]:
        assert hf_tok(text)["input_ids"] == tok.encode(text)
        assert hf_tok.decode(tok.encode(text), skip_special_tokens=True) == text
    ids = torch.tensor([tok.encode("The quick brown fox")])
    with torch.no_grad():
        ours = model(ids, torch.arange(ids.shape[1])[None], causal_mask(torch.ones_like(ids, dtype=torch.bool),
                                                                        ids.shape[1]))
        theirs = hf(ids).logits
    assert torch.allclose(ours, theirs, atol=1e-5)
    again, meta = load_checkpoint(folder)
    assert meta == {"version": 4}
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_batched_sampling_logprobs_match_a_forward_pass():
    model = fresh_policy(5)
    tok = ByteTokenizer()
    prompts = [tok.encode(p) for p in ["a", "a much longer prompt than the first", "mid-length one"]]
    samples = sample(model, prompts, SamplingParams(temperature=1.0, top_p=1.0, max_tokens=20, seed=7))
    for prompt, s in zip(prompts, samples):
        ids = torch.tensor([prompt + s.token_ids])
        logp, _ = sequence_logprobs(model, ids, torch.ones_like(ids, dtype=torch.bool))
        assert torch.allclose(logp[0, len(prompt) - 1:], torch.tensor(s.logprobs), atol=1e-4)


@pytest.mark.parametrize("kind,layout", [("builtin", "mixed"), ("builtin", "groups"), ("builtin-gqa", "groups"),
                                         ("transformers", "mixed")])
def test_rows_sharing_a_prompt_score_and_train_as_if_each_read_it_whole(tmp_path, monkeypatch, kind, layout):
    """The learner's path (prompt_lengths: each distinct prompt read once, its rows continuing it)
    gives the same log-probs, entropies and gradients as reading every row whole: prompts of several
    lengths, shared by some rows and not others, continuations of every length from none to nine,
    per-row temperature and top_p (tokens outside the nucleus score -inf in both). The built-in
    policy and the same weights loaded by transformers (its KV cache carries the gradient). With
    each prompt's rows together, as many of each (`groups`, as the learner's batches come), the
    built-in policy's rows read their prompt's keys through grouped_attention, with one key head per
    query head and with two query heads to a key head (`builtin-gqa`)."""
    generator = torch.Generator().manual_seed(11)
    model = fresh_policy(6, PolicyConfig(num_key_value_heads=2) if kind == "builtin-gqa" else None)
    with torch.no_grad():  # sharper than a fresh init, so that top_p leaves tokens out
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    if kind == "transformers":
        from transformers import AutoModelForCausalLM

        from crucible.ml.policy import hf

        model = AutoModelForCausalLM.from_pretrained(save_checkpoint(model, tmp_path / "hf", {"version": 0}),
                                                     local_files_only=True)
        shared_reads = []
        read_once = hf.continuation_logits
        monkeypatch.setattr(hf, "continuation_logits", lambda *a: shared_reads.append(1) or read_once(*a))
    grouped = []
    monkeypatch.setattr(policy_model, "grouped_attention",
                        lambda *a, read=policy_model.grouped_attention: grouped.append(1) or read(*a))
    prompts = [[1, *torch.randint(3, 200, (n,), generator=generator).tolist()] for n in (0, 4, 11, 4, 7)]
    # mixed: row i continues prompt i % 5 (23 rows); groups: rows 3k..3k+2 continue prompt k (15 rows:
    # 3 a prompt, not the 4 heads, so that mixing up the two fails on shapes as well as on values)
    which = [i % len(prompts) for i in range(23)] if layout == "mixed" else [i // 3 for i in range(15)]
    rows = [(prompts[k], torch.randint(3, 250, (i % 10,), generator=generator).tolist()) for i, k in enumerate(which)]
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    valid = torch.zeros((len(rows), width), dtype=torch.bool)
    scored = torch.zeros((len(rows), width - 1), dtype=torch.bool)
    for i, (p, c) in enumerate(rows):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        valid[i, :len(p) + len(c)] = True
        scored[i, len(p) - 1:len(p) + len(c) - 1] = True
    temperature = torch.rand(len(rows), generator=generator) + 0.5
    top_p = torch.where(torch.arange(len(rows)) % 2 == 0, torch.ones(len(rows)),
                        torch.rand(len(rows), generator=generator) * 0.5 + 0.4)
    lengths = torch.tensor([len(p) for p, _ in rows])

    def run(**options):
        model.zero_grad()
        logp, entropy = sequence_logprobs(model, ids, valid, temperature, top_p, **options)
        finite = scored & torch.isfinite(logp)
        (logp[finite].sum() + entropy[scored].sum()).backward()
        return logp, entropy, [p.grad.clone() for p in model.parameters()]

    whole_logp, whole_entropy, whole_grads = run()
    shared_logp, shared_entropy, shared_grads = run(prompt_lengths=lengths)
    if kind == "transformers":
        assert shared_reads  # the shared path ran, not the whole rows again
    assert bool(grouped) == (layout == "groups")  # 3 rows a prompt together: read through grouped_attention
    assert bool(torch.isinf(whole_logp[scored]).any())  # the nucleus case is exercised
    assert torch.equal(torch.isinf(whole_logp[scored]), torch.isinf(shared_logp[scored]))
    finite = scored & torch.isfinite(whole_logp)
    assert torch.allclose(shared_logp[finite], whole_logp[finite], atol=1e-5)
    assert torch.allclose(shared_entropy[scored], whole_entropy[scored], atol=1e-5)
    assert bool((shared_logp[~scored] == 0).all()) and bool((shared_entropy[~scored] == 0).all())
    scale = max(float(g.abs().max()) for g in whole_grads)
    assert scale > 1e-2  # a real gradient
    # float32 rounding of sums taken in another order: 4e-6 of the largest component here (in float64
    # the two paths agree to 4e-15)
    for shared, whole in zip(shared_grads, whole_grads):
        assert float((shared - whole).abs().max()) <= 2e-5 * scale


def test_samples_of_a_shared_prompt_are_those_drawn_from_it_row_by_row():
    """The sampler reads a prompt its rows share once: what it draws is what it drew when every row
    read its own copy (same seed, same tokens, same log-probs), here against one row at a time."""
    model = fresh_policy(5)
    tok = ByteTokenizer()
    prompts = [tok.encode("parity 4 7 1 9 =")] * 3 + [tok.encode("size 2 =")] * 2 + [tok.encode("x")]
    params = SamplingParams(temperature=0.0, top_p=1.0, max_tokens=12)
    together = sample(model, prompts, params)
    for prompt, s in zip(prompts, together):
        [alone] = sample(model, [prompt], params)
        assert s.token_ids == alone.token_ids
        assert s.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=4)
    drawn = sample(model, prompts, seeded)
    for prompt, s in zip(prompts, drawn):
        ids = torch.tensor([prompt + s.token_ids])
        logp, _ = sequence_logprobs(model, ids, torch.ones_like(ids, dtype=torch.bool), 1.0, 0.9)
        assert torch.allclose(logp[0, len(prompt) - 1:], torch.tensor(s.logprobs), atol=1e-4)
    assert len({tuple(s.token_ids) for s in drawn[:3]}) > 1  # rows of one prompt still draw apart


def test_sampling_is_seeded_and_greedy_is_deterministic():
    model = fresh_policy(5)
    prompts = [ByteTokenizer().encode("x")] * 3
    a = sample(model, prompts, SamplingParams(temperature=1.0, top_p=1.0, max_tokens=10, seed=1))
    b = sample(model, prompts, SamplingParams(temperature=1.0, top_p=1.0, max_tokens=10, seed=1))
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    g = sample(model, prompts, SamplingParams(temperature=0.0, top_p=1.0, max_tokens=10))
    assert len({tuple(s.token_ids) for s in g}) == 1


def test_hf_backend_matches_the_torch_policy(tmp_path):
    model = fresh_policy(8)
    folder = save_checkpoint(model, tmp_path / "hf", {"version": 0})
    backend = create_backend("hf", checkpoint=str(folder))
    groups = backend.sample(["hello", "a longer prompt"], 2, SamplingParams(temperature=1.0, top_p=1.0, max_tokens=8, seed=3))
    for group in groups:
        assert len(group) == 2
        for c in group:
            ids = torch.tensor([c.prompt_token_ids + c.token_ids])
            logp, _ = sequence_logprobs(model, ids, torch.ones_like(ids, dtype=torch.bool))
            assert torch.allclose(logp[0, len(c.prompt_token_ids) - 1:], torch.tensor(c.logprobs), atol=1e-4)


async def test_lag_bound_pauses_until_a_new_version(tmp_path):
    backend = create_backend("torch", seed=1)
    batcher = Batcher(backend, max_tasks=1, wait_ms=0, lag=LagBound(max_lag=0, groups_per_step=2))
    batcher.start()
    try:
        params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=2)
        await asyncio.wait_for(batcher.sample("a", 1, params), 10)
        await asyncio.wait_for(batcher.sample("b", 1, params), 10)
        third = asyncio.create_task(batcher.sample("c", 1, params))  # a third group at version 0: too far ahead
        await asyncio.sleep(0.5)
        assert not third.done() and batcher.waiting_for_policy
        # Interactive requests are not held back by the bound.
        _, version, _ = await asyncio.wait_for(batcher.sample("grpc", 1, params, counts_for_lag=False), 10)
        assert version == 0
        folder = save_checkpoint(fresh_policy(2), tmp_path / "v1", {"version": 1})
        batcher.offer_weights(1, str(folder))
        _, version, _ = await asyncio.wait_for(third, 10)
        assert version == 1 and not batcher.waiting_for_policy
    finally:
        await batcher.stop()


async def test_a_task_fed_for_a_newer_version_waits_for_it(tmp_path):
    """The feeder publishes a step's tasks once it has seen a version; a generator that has not loaded
    it yet (its hash still being checked) samples them with it, not with the version before."""
    backend = create_backend("torch", seed=1)
    batcher = Batcher(backend, max_tasks=4, wait_ms=0, lag=LagBound(max_lag=1, groups_per_step=4))
    batcher.start()
    try:
        params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=2)
        fed = asyncio.create_task(batcher.sample("a", 2, params, min_version=1))
        _, version, _ = await asyncio.wait_for(batcher.sample("b", 2, params), 10)  # nothing asked: version 0
        assert version == 0 and not fed.done()
        folder = save_checkpoint(fresh_policy(2), tmp_path / "v1", {"version": 1})
        checked = asyncio.Event()

        async def check():  # the generator's hash check of the checkpoint, which takes a while
            await checked.wait()
            return str(folder)

        batcher.offer_weights(1, str(folder), check)
        await asyncio.sleep(0.3)
        assert not fed.done()  # offered but not checked: still waiting
        checked.set()
        completions, version, _ = await asyncio.wait_for(fed, 10)
        assert version == 1 and len(completions) == 2
        # A version this generator never gets (refused, or never published) holds a task back only so long.
        batcher.MIN_VERSION_WAIT_S = 0.3
        _, version, _ = await asyncio.wait_for(batcher.sample("c", 1, params, min_version=5), 10)
        assert version == 1
    finally:
        await batcher.stop()


@pytest.mark.slow
def test_warm_start_teaches_the_answer_format():
    pairs = [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]
    model = fresh_policy(0)
    tok = ByteTokenizer()
    prompts = [tok.encode(p) for p, _ in pairs[:32]]

    def parse_rate():
        out = sample(model, prompts, SamplingParams(temperature=0.0, top_p=1.0, max_tokens=6))
        return sum(bool(re.fullmatch(r"\d+", s.text)) and s.token_ids[-1] == EOS_ID for s in out) / len(out)

    before = parse_rate()
    warm_start(model, pairs, steps=150, batch_size=32, lr=3e-3)
    assert before < 0.2 and parse_rate() > 0.9


async def test_a_request_whose_caller_has_gone_is_not_sampled():
    """Generate calls past their deadline were still sampled, for nobody, ahead of the run's own work."""
    backend = create_backend("torch", seed=1)
    batcher = Batcher(backend, max_tasks=1, wait_ms=50, lag=LagBound(max_lag=-1, groups_per_step=1))
    batcher.start()
    try:
        params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=8)
        calls = [asyncio.create_task(batcher.sample(f"p{i}", 2, params, counts_for_lag=False)) for i in range(10)]
        await asyncio.sleep(0)  # every request is queued
        for gone in calls[1:]:
            gone.cancel()
        completions, _, _ = await asyncio.wait_for(calls[0], 10)
        await asyncio.sleep(0.3)
        assert batcher.batches == 1 and batcher.tokens == sum(len(c.token_ids) for c in completions)
    finally:
        await batcher.stop()


async def test_a_version_offered_while_a_batch_gathers_is_loaded_not_dropped(tmp_path):
    """The offer's signal, taken off the queue while a batch waited for company, was dropped: the version
    was loaded only once another request came, and with the lag bound spent none could (sampling deadlocked)."""
    backend = create_backend("torch", seed=1)
    batcher = Batcher(backend, max_tasks=4, wait_ms=300, lag=LagBound(max_lag=0, groups_per_step=1))
    batcher.start()
    try:
        params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=2)
        first = asyncio.create_task(batcher.sample("a", 1, params))
        await asyncio.sleep(0.05)  # the loop holds "a", gathering company for it
        batcher.offer_weights(1, str(save_checkpoint(fresh_policy(2), tmp_path / "v1", {"version": 1})))
        await asyncio.wait_for(first, 10)
        _, version, _ = await asyncio.wait_for(batcher.sample("b", 1, params), 10)  # the budget needs version 1
        assert version == 1 and backend.version == 1
    finally:
        await batcher.stop()
