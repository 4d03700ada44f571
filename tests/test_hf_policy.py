"""Any Hugging Face causal LM as the policy: sampled, scored, trained, checkpointed, hot-swapped.

The model is a tiny random Llama built here (transformers' own LlamaForCausalLM, not the built-in
policy's code), with the byte-level tokenizer saved in Hugging Face's format beside it.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from crucible.ml.policy import hf
from crucible.ml.policy.backends.hf_backend import HFBackend
from crucible.ml.policy.checkpoint import load_checkpoint, save_checkpoint
from crucible.ml.policy.model import Policy, sequence_logprobs
from crucible.ml.policy.sampling import SamplingParams
from crucible.ml.policy.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, ByteTokenizer
from crucible.services.learner.trainer import Trainer
from crucible.shared import bus, messages
from crucible.shared.settings import RunConfig
from crucible.v1 import policy_pb2, rollout_pb2, task_pb2, trajectory_pb2
from tests.test_bus import read_raw

# Sampling (a KV cache, left padding) and the learner's recomputation (one full forward, right
# padding) run the same float32 weights; they differ only in summation order. (With top_p < 1 a
# token sitting exactly on the nucleus boundary can fall on the other side of it in one of the two,
# which moves that position's log-prob by the boundary token's share; see distribution.py. The
# per-token comparisons here therefore sample at top_p = 1; tests/test_learner.py checks top_p 0.9
# through the batch's mean importance ratio.)
LOGPROB_TOLERANCE = 1e-4


def tiny_llama(folder, seed: int = 0):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model = LlamaForCausalLM(config)
    # A converted tokenizer may name the wrong EOS (SmolLM2's GGUF does): the generation config is trusted.
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(str(folder))
    ByteTokenizer().save(folder)
    return folder


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("llama") / "init")


def samples_from(backend, prompts, n, temperature, top_p, version=0, rewards=None):
    groups = backend.sample(prompts, n, SamplingParams(temperature=temperature, top_p=top_p, max_tokens=8))
    out = []
    for g, (prompt, group) in enumerate(zip(prompts, groups)):
        rs = rewards or [float(i % 2) for i in range(n)]
        mean = sum(rs) / len(rs)
        for i, (c, r) in enumerate(zip(group, rs)):
            out.append(trajectory_pb2.Trajectory(
                id=f"g{g}/{i}", group_id=f"g{g}", sample_index=i, group_size=n, policy_version=version,
                prompt_token_ids=c.prompt_token_ids, completion_token_ids=c.token_ids, logprobs=c.logprobs,
                temperature=temperature, top_p=top_p, reward=r, advantage=r - mean, group_received=n,
                group_complete=True))
    return out


def test_a_transformers_folder_is_not_the_builtin_policy(llama, tmp_path):
    model, _ = load_checkpoint(llama)
    assert not isinstance(model, Policy) and not hf.is_builtin(llama)
    from crucible.ml.policy.checkpoint import fresh_policy

    builtin = save_checkpoint(fresh_policy(0), tmp_path / "builtin", {"version": 0})
    assert hf.is_builtin(builtin) and isinstance(load_checkpoint(builtin)[0], Policy)


def test_learner_logprobs_match_the_samplers_within_tolerance(llama):
    backend = HFBackend(str(llama), sample_seed=3)
    samples = samples_from(backend, ["2+2=", "a longer prompt: 12*3="], 4, temperature=0.7, top_p=1.0)
    model, _ = load_checkpoint(llama)
    worst = 0.0
    for s in samples:
        ids = torch.tensor([list(s.prompt_token_ids) + list(s.completion_token_ids)])
        logp, _ = sequence_logprobs(model, ids, torch.ones_like(ids, dtype=torch.bool), s.temperature, s.top_p)
        got = logp[0, len(s.prompt_token_ids) - 1:].tolist()
        worst = max(worst, max(abs(a - b) for a, b in zip(got, s.logprobs)))
    assert worst < LOGPROB_TOLERANCE
    assert any(len(s.completion_token_ids) > 1 for s in samples)


def test_micro_batches_accumulate_to_the_whole_batchs_update(llama):
    backend = HFBackend(str(llama), sample_seed=5)
    samples = samples_from(backend, ["1+1=", "3+4=", "9-2="], 4, temperature=1.0, top_p=1.0)
    whole = Trainer(load_checkpoint(llama)[0], RunConfig(lr=1e-2))
    micro = Trainer(load_checkpoint(llama)[0], RunConfig(lr=1e-2, micro_batch_size=5, gradient_checkpointing=True))
    a, b = whole.step(samples), micro.step(samples)
    assert a.stepped and b.stepped
    assert a.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # fresh samples, same weights
    assert b.metrics["loss"] == pytest.approx(a.metrics["loss"], abs=1e-5)
    assert b.metrics["grad_norm"] == pytest.approx(a.metrics["grad_norm"], rel=1e-4)
    # The gradients the optimiser stepped on (left in .grad) are the same, to float32 summation noise.
    scale = max(float(p.grad.abs().max()) for p in whole.model.parameters())
    for p, q in zip(whole.model.parameters(), micro.model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=scale * 1e-5)


def test_a_trained_checkpoint_is_a_folder_transformers_loads_and_the_sampler_swaps_in(llama, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    backend = HFBackend(str(llama), sample_seed=7)
    trainer = Trainer(load_checkpoint(llama)[0], RunConfig(lr=5e-2))
    assert trainer.step(samples_from(backend, ["5+5="], 6, temperature=1.0, top_p=1.0)).stepped
    folder = save_checkpoint(trainer.model, tmp_path / "v000001", {"version": 1}, tokenizer_from=llama)
    assert AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True) is not None
    assert AutoTokenizer.from_pretrained(str(folder), local_files_only=True)("hi")["input_ids"]
    backend.load_weights(1, folder.as_uri())
    assert backend.version == 1
    fresh = samples_from(backend, ["5+5="], 3, temperature=1.0, top_p=1.0, version=1)
    for s in fresh:  # the swapped-in weights are the trained ones
        ids = torch.tensor([list(s.prompt_token_ids) + list(s.completion_token_ids)])
        logp, _ = sequence_logprobs(trainer.model, ids, torch.ones_like(ids, dtype=torch.bool))
        got = logp[0, len(s.prompt_token_ids) - 1:].tolist()
        assert max(abs(a - b) for a, b in zip(got, s.logprobs)) < LOGPROB_TOLERANCE


@pytest.mark.kafka
@pytest.mark.store
async def test_the_services_sample_train_publish_and_hot_swap_a_transformers_model(stack_settings, llama, tmp_path):
    from crucible.services.generator.__main__ import run as generator_run
    from crucible.services.learner.__main__ import run as learner_run
    from crucible.shared.procs import free_port

    settings = stack_settings.model_copy(update={
        "home": tmp_path, "run_id": "hf-run", "init_checkpoint": llama.as_uri(), "groups_per_step": 1,
        "max_tokens": 6, "temperature": 1.0, "generator_grpc_port": free_port(), "generator_batch_wait_ms": 5.0,
        "max_policy_lag": -1, "lr": 5e-2})
    await bus.ensure_topics(["tasks", "rollouts", "trajectories", "policy", "alerts"], settings=settings)
    stop = asyncio.Event()
    services = [asyncio.create_task(generator_run(settings, stop)), asyncio.create_task(learner_run(settings, stop))]
    task = task_pb2.Task(id="t", kind="exact", prompt="2+2=", group_size=4, answer=task_pb2.ExpectedAnswer(answer="4"))
    try:
        async with bus.Producer(settings) as producer:
            await producer.send_and_wait("tasks", task, key="t")
            first = messages.decode((await read_raw(settings, "rollouts", 1, 120))[0].value, rollout_pb2.RolloutGroup)
            assert first.backend == "hf" and first.policy_version == 0 and len(first.rollouts) == 4
            # The learner trains on the group (as the aggregator would send it) and publishes version 1.
            for i, r in enumerate(first.rollouts):
                await producer.send_and_wait("trajectories", trajectory_pb2.Trajectory(
                    id=r.id, task_id="t", group_id=first.group_id, sample_index=i, group_size=4,
                    policy_version=0, prompt_token_ids=first.prompt_token_ids, completion_token_ids=r.token_ids,
                    logprobs=r.logprobs, temperature=first.temperature, top_p=first.top_p, reward=float(i % 2),
                    advantage=float(i % 2) - 0.5, group_received=4, group_complete=True), key=first.group_id)
            versions = [messages.decode(r.value, policy_pb2.PolicyVersion) for r in await read_raw(settings, "policy", 2, 120)]
            assert [v.version for v in versions] == [0, 1]
            assert hf.is_builtin(tmp_path / "runs" / "hf-run" / "checkpoints" / "v000001") is False
            # The generator swaps version 1 in before its next batch.
            for attempt in range(60):
                await producer.send_and_wait("tasks", task_pb2.Task(
                    id=f"t{attempt}", kind="exact", prompt="2+2=", group_size=2, answer=task_pb2.ExpectedAnswer(answer="4")))
                groups = [messages.decode(r.value, rollout_pb2.RolloutGroup)
                          for r in await read_raw(settings, "rollouts", attempt + 2, 120)]
                if groups[-1].policy_version == 1:
                    break
                await asyncio.sleep(0.5)
            assert groups[-1].policy_version == 1
    finally:
        stop.set()
        await asyncio.gather(*services, return_exceptions=True)


def smollm2_folder():
    from crucible.ml import models
    from crucible.shared.settings import Settings

    try:
        return models.resolve("smollm2-135m", Settings())
    except (ValueError, models.ModelError):
        return None


@pytest.mark.slow
@pytest.mark.skipif(smollm2_folder() is None, reason="SmolLM2 not added here (crucible models add smollm2-135m)")
def test_smollm2_samples_trains_one_step_and_swaps(tmp_path):
    """The real pretrained model, read from where `crucible models add` put it (never written to)."""
    folder = smollm2_folder()
    backend = HFBackend(str(folder), sample_seed=1, chat_template=True, system_prompt="Answer briefly.")
    samples = samples_from(backend, ["What is 47+38?", "What is 12+30?"], 4, temperature=1.0, top_p=1.0)
    assert all(s.completion_token_ids for s in samples)
    model, _ = load_checkpoint(folder)
    worst = 0.0
    for s in samples:
        ids = torch.tensor([list(s.prompt_token_ids) + list(s.completion_token_ids)])
        logp, _ = sequence_logprobs(model, ids, torch.ones_like(ids, dtype=torch.bool))
        worst = max(worst, max(abs(a - b) for a, b in zip(logp[0, len(s.prompt_token_ids) - 1:].tolist(), s.logprobs)))
    assert worst < LOGPROB_TOLERANCE
    trainer = Trainer(model, RunConfig(lr=1e-5, micro_batch_size=4, gradient_checkpointing=True))
    result = trainer.step(samples)
    assert result.stepped and result.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    saved = save_checkpoint(trainer.model, tmp_path / "v000001", {"version": 1}, tokenizer_from=folder)
    backend.load_weights(1, saved.as_uri())
    assert backend.version == 1 and backend.sample(["What is 2+2?"], 1, SamplingParams(0.0, 1.0, 4))[0][0].token_ids


def test_lora_trains_adapters_only_and_checkpoints_merged_weights(llama, tmp_path):
    pytest.importorskip("peft")
    backend = HFBackend(str(llama), sample_seed=11)
    samples = samples_from(backend, ["3+3=", "8-5="], 6, temperature=1.0, top_p=1.0)
    base = [p.detach().clone() for p in load_checkpoint(llama)[0].parameters()]
    trainer = Trainer(load_checkpoint(llama)[0], RunConfig(lr=5e-2, lora_rank=4, lora_alpha=8))
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert 0 < trainable < sum(p.numel() for p in base) / 4  # adapters only
    result = trainer.step(samples)
    assert result.stepped and result.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # B = 0 at start
    folder = save_checkpoint(trainer.model, tmp_path / "v000001", {"version": 1}, tokenizer_from=llama)
    merged, _ = load_checkpoint(folder)  # a plain transformers model: generators need no peft
    assert not hasattr(merged, "peft_config")
    changed = [float((m.detach() - b).abs().max()) for m, b in zip(merged.parameters(), base)]
    assert max(changed) > 0, "the merged checkpoint carries the adapters' update"
    for s in samples[:3]:  # and it is the trained policy: same log-probs as the adapted model
        ids = torch.tensor([list(s.prompt_token_ids) + list(s.completion_token_ids)])
        valid = torch.ones_like(ids, dtype=torch.bool)
        a, _ = sequence_logprobs(merged, ids, valid)
        b, _ = sequence_logprobs(trainer.model, ids, valid)
        assert float((a - b).detach().abs().max()) < LOGPROB_TOLERANCE


def test_a_chat_template_that_cannot_render_a_prompt_is_refused_at_start(llama, tmp_path):
    """A template refusing a system role (Gemma's), or rendering a prompt to nothing, failed every task, each
    dead-lettered as a handler failure, while the generator looked healthy."""
    import shutil

    from crucible.ml.policy import hf

    for name, template, system, said in [
            ("no-system", "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role "
             "not supported') }}{% endif %}{{ m['content'] }}{% endfor %}", "Answer briefly.", "System role"),
            ("empty", "{% for m in messages %}{% endfor %}", "", "no tokens")]:
        folder = shutil.copytree(llama, tmp_path / name)
        tokenizer = hf.load_tokenizer(folder)
        tokenizer.chat_template = template
        tokenizer.save_pretrained(str(folder))
        with pytest.raises(ValueError, match=said):
            HFBackend(str(folder), chat_template=True, system_prompt=system)
    HFBackend(str(tmp_path / "no-system"), chat_template=True)  # without a system prompt it renders
