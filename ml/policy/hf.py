"""Any Hugging Face causal LM as a policy: loaded offline from a folder, scored, saved as a folder.

The built-in policy (ml/policy/model.py) is one such folder too; its config.json says
`"crucible_policy": "builtin"`, and `is_builtin` tells the two apart, so that a checkpoint picks
its own code path wherever it is loaded (generator, learner, evaluator).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from crucible.ml.policy.model import positions_of, scored

BUILTIN_MARK = "crucible_policy"
# What a folder's tokenizer and prompt formatting consist of: copied as they are into every checkpoint.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")


def offline() -> None:
    """Never reach a model hub: every model comes from a local folder."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def is_builtin(folder: Path) -> bool:
    try:
        return json.loads((Path(folder) / "config.json").read_text()).get(BUILTIN_MARK) == "builtin"
    except (OSError, ValueError):
        return False


def dtype_for(device: str) -> torch.dtype:
    """bf16 where the GPU supports it, float32 on the CPU (bf16 matmuls there are slow and lossy)."""
    if device.startswith("cuda") and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def load_model(folder: Path, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    offline()
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype_for(device), local_files_only=True).to(device)


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    offline()
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if tokenizer.pad_token_id is None:  # padding is always masked out: any real token will do
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.convert_ids_to_tokens(0)
    return tokenizer


def eos_ids(model, tokenizer) -> set[int]:
    """The ids that end a completion: the generation config's (a converted tokenizer may name the wrong
    one), else the tokenizer's."""
    config = getattr(model, "generation_config", None)
    value = getattr(config, "eos_token_id", None) if config is not None else None
    if value is None:
        value = tokenizer.eos_token_id
    ids = value if isinstance(value, (list, tuple)) else [value]
    return {int(i) for i in ids if i is not None}


def render(tokenizer, prompt: str, chat_template: bool, system_prompt: str = "") -> str:
    """The text a model continues: the prompt itself, or the model's chat template around it."""
    if not chat_template:
        return prompt
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _template_source(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return template if isinstance(template, str) else " ".join(map(str, template.values()))


def episode_prompt(tokenizer, instructions: str, tools: list[dict], tools_text: str, chat_template: bool,
                   system_prompt: str = "") -> str:
    """The first text of a multi-turn episode: tool schemas through the chat template when it renders
    tools, in the system prompt (`tools_text`) when it does not, after the prompt without a template."""
    if not chat_template:
        return f"{instructions}\n\n{tools_text}\n"
    renders_tools = "tools" in _template_source(tokenizer)
    system = system_prompt if renders_tools else "\n\n".join(p for p in (system_prompt, tools_text) if p)
    messages = ([{"role": "system", "content": system}] if system else [])
    messages.append({"role": "user", "content": instructions})
    return tokenizer.apply_chat_template(messages, tools=tools if renders_tools else None, tokenize=False,
                                         add_generation_prompt=True)


_MARK = "\x00crucible-turn\x00"


def observation_text(tokenizer, observation: str, chat_template: bool, turn_end: str = "") -> str:
    """What follows a model turn when the environment answers: the end of the assistant's turn (unless
    the model already wrote it, `turn_end`), the observation as the template gives a tool's answer,
    and the start of the next assistant turn."""
    if not chat_template:
        return f"\n<tool_response>\n{observation}\n</tool_response>\n"
    source = _template_source(tokenizer)
    tool_message = ({"role": "tool", "content": observation} if "tool" in source.replace("tools", "")
                    else {"role": "user", "content": f"<tool_response>\n{observation}\n</tool_response>"})
    base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
    full = tokenizer.apply_chat_template(base + [tool_message], tokenize=False, add_generation_prompt=True)
    suffix = full[full.index(_MARK) + len(_MARK):]
    if turn_end and suffix.startswith(turn_end):
        suffix = suffix[len(turn_end):]
    return suffix


_OBSERVATION = "\x00crucible-observation\x00"


def observation_ids(tokenizer, observation: str, chat_template: bool, turn_end: str = "") -> list[int]:
    """The token ids of observation_text, the observation itself read as text only: a tool's output, or a
    task's data, that spells a special token (`<|im_end|>`, `<|im_start|>assistant`) is never that token,
    so nothing an environment shows can end the tool's message or start a turn in the model's context.
    The template's own text around it is read as the template means it."""
    text = observation_text(tokenizer, _OBSERVATION, chat_template, turn_end)
    if text.count(_OBSERVATION) != 1:  # a template that rewrites message contents: read whole, specials defused
        text = observation_text(tokenizer, _defused(tokenizer, observation), chat_template, turn_end)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    before, _, after = text.partition(_OBSERVATION)
    return (tokenizer(before, add_special_tokens=False)["input_ids"]
            + tokenizer(observation, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            + tokenizer(after, add_special_tokens=False)["input_ids"])


def _defused(tokenizer, text: str) -> str:
    """`text` with every special token's spelling broken by a zero-width space after its first character."""
    for special in sorted(set(tokenizer.all_special_tokens) | set(getattr(tokenizer, "added_tokens_encoder", {})),
                          key=len, reverse=True):
        if len(special) > 1 and special in text:
            text = text.replace(special, special[0] + "\u200b" + special[1:])
    return text


def sequence_logprobs(model, ids: torch.Tensor, valid: torch.Tensor, temperature=1.0, top_p=1.0):
    """As crucible.ml.policy.model.sequence_logprobs, for a transformers model."""
    out = model(input_ids=ids, attention_mask=valid.long(), position_ids=positions_of(valid), use_cache=False)
    return scored(out.logits[:, :-1].float(), ids[:, 1:], temperature, top_p)


def continuation_logits(model, prompts, tokens: torch.Tensor, positions: torch.Tensor, own: torch.Tensor):
    """Logits [B, C, V]: position j's predict token j of each row's continuation `tokens` (the first from its
    prompt's last token). Each prompt (`prompts`: crucible.ml.policy.model.Prompts, left-padded) is read
    once, and its cache, copied to the rows that continue it, carries the gradient back to it."""
    first = model(input_ids=prompts.ids, attention_mask=prompts.valid.long(), position_ids=positions_of(prompts.valid),
                  use_cache=True, logits_to_keep=1)
    past = first.past_key_values
    past.reorder_cache(prompts.rows)
    rest = model(input_ids=tokens, attention_mask=torch.cat((prompts.valid[prompts.rows], own), dim=1).long(),
                 position_ids=positions, past_key_values=past, use_cache=True)
    return torch.cat((first.logits[prompts.rows, -1:], rest.logits[:, :-1]), dim=1)


def write(model, tmp: Path, tokenizer_from: Path | None, weights: dict | None = None) -> None:
    """A transformers model's files into a checkpoint being written (see checkpoint.save_checkpoint):
    weights and configs, and the tokenizer files of `tokenizer_from`. LoRA adapters are merged in.
    `weights`: the whole state dict where the model holds a shard (FSDP)."""
    if hasattr(model, "merge_and_unload"):  # LoRA: generators load plain weights
        model = _merged_copy(model)
    model.save_pretrained(str(tmp), safe_serialization=True, **({"state_dict": weights} if weights else {}))
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_from) / name).exists():
                shutil.copy2(Path(tokenizer_from) / name, tmp / name)


def _merged_copy(peft_model):
    import copy

    return copy.deepcopy(peft_model).merge_and_unload()
