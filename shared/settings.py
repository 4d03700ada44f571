"""All configuration in one typed place; every field is CRUCIBLE_<NAME> in the environment."""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"  # a run id names folders, topics and consumer groups


def shown_url(url: str) -> str:
    """`url` as a log line, a message or the terminal may show it (never to connect to): the password of
    credentials written in it (http://user:password@host, which the store takes) masked, up to the
    string's last @, however malformed the URL (a password with an unescaped / or @, no scheme)."""
    return _URL_PASSWORD.sub(r"\1\2:***@", url)


_URL_PASSWORD = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)?([^:/@]*):(?!//).*@", re.DOTALL)


def run_id_problem(run_id: str) -> str | None:
    """Why `run_id` cannot name a run (a caller's, in a request), or None."""
    import re

    if re.fullmatch(RUN_ID_PATTERN[1:-1], run_id):
        return None
    return (f"run id {run_id[:80]!r}{'...' if len(run_id) > 80 else ''} is not a run id: letters, digits, '.', '_' "
            "and '-', at most 128, starting with a letter or digit")


# Sampling's bounds, wherever sampling parameters are taken (a recipe, a Generate call, a trajectory the
# learner trains on: logits divided by a temperature, and probabilities cut at top_p, must stay finite and
# above zero in float32).
TEMPERATURES = (1e-6, 10.0)  # above 0, at least the first
SMALLEST_TOP_P = 1e-30


def sampling_problem(temperature: float, top_p: float) -> str | None:
    """Why (temperature, top_p) is no sampling distribution, or None."""
    if not (temperature == 0.0 or TEMPERATURES[0] <= temperature <= TEMPERATURES[1]):
        return f"temperature {temperature} must be 0 (greedy) or from {TEMPERATURES[0]:g} to {TEMPERATURES[1]:g}"
    if not SMALLEST_TOP_P <= top_p <= 1.0 and temperature != 0.0:
        return f"top_p {top_p} must be from {SMALLEST_TOP_P:g} to 1"
    return None


class RunConfig(BaseModel):
    """What a training run decides, each with its one default: sampling, the algorithm and its
    hyperparameters, rewards. Every service reads the fields it needs from here (through Settings,
    so each is also CRUCIBLE_<NAME> in the environment); `crucible train` sets them per run.
    No number of it is infinite or NaN (an infinite learning rate made every weight infinite, past the
    learner's check of the loss and the gradient)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    run_id: str = Field(default="local", pattern=RUN_ID_PATTERN,
                        description="Names the training run in stored rows and checkpoints; what the run's "
                                    "services sign is signed with a key of the run's own (shared/integrity.py), so "
                                    "every service of a run, and whoever submits tasks to it, sets the same one.")
    seed: int = Field(default=0, description="Seeds the initial policy (when no init_checkpoint) and sampling.")
    init_checkpoint: str | None = Field(default=None, description="Starting weights of the policy and the frozen "
                                        "KL reference: a checkpoint folder or file:// URI, the built-in policy's or "
                                        "any Hugging Face causal LM's; unset: a fresh built-in policy from `seed`.")

    # how a task becomes the text the model continues
    chat_template: bool = Field(default=False, description="Wrap each prompt in the model's chat template.")
    system_prompt: str = Field(default="", max_length=16_384, pattern=r"^[^\x00]*$",
                               description="The system message, when the chat template is used (no NUL: it "
                               "travels to each service in its environment).")

    # sampling
    temperature: float = Field(default=1.0, ge=0.0, le=TEMPERATURES[1],
                               description=f"0: greedy; otherwise {TEMPERATURES[0]:g} to {TEMPERATURES[1]:g}")
    top_p: float = Field(default=1.0, ge=SMALLEST_TOP_P, le=1.0)

    @field_validator("temperature")
    @classmethod
    def _a_temperature(cls, temperature: float) -> float:
        if problem := sampling_problem(temperature, 1.0):
            raise ValueError(problem)
        return temperature
    max_tokens: int = Field(default=64, ge=1, le=4096, description="Tokens per completion (per turn in an episode).")
    max_episode_tokens: int = Field(default=480, ge=16, description="Tokens a multi-turn episode may hold in all "
                                    "(prompt, turns, observations); a task's environment.max_tokens may ask for fewer.")

    # how sampling and learning interleave
    groups_per_step: int = Field(default=16, ge=1, description="Groups the learner trains on per policy step.")
    max_policy_lag: int = Field(default=2, ge=-1, description="Policy versions a sample may lag behind the "
                                "learner: the generator runs at most this many learner steps ahead, the learner "
                                "drops older samples; -1 turns the bound off.")

    dynamic_sampling: bool = Field(default=False, description="Filter groups whose rewards are all equal (no "
                                   "learning signal) before the optimiser: a step waits for groups_per_step "
                                   "informative groups (DAPO's dynamic sampling), counting what it filtered. Off "
                                   "by default: on the built-in recipe it reaches the same held-out pass rate in "
                                   "more wall time (the extra sampling costs more than the steps it saves).")
    dynamic_sampling_window: int = Field(default=4, ge=1, description="With dynamic sampling, a step also goes "
                                         "ahead once this many times groups_per_step groups arrived since the "
                                         "last: on the informative ones, or on uninformative ones when none is, "
                                         "so a solved (or hopeless) task set still advances.")

    def groups_a_step_may_take(self) -> int:
        """Groups one learner step may consume: groups_per_step, or with dynamic sampling up to
        dynamic_sampling_window times that (the filtered ones count)."""
        return self.groups_per_step * (self.dynamic_sampling_window if self.dynamic_sampling else 1)

    # rewards and advantages
    estimator: str = Field(default="grpo", pattern="^(grpo|rloo|reinforce)$")
    reward_weights: dict[str, float] = Field(default_factory=dict, max_length=64,
                                             description="Component weights (JSON); empty: the verifier's default "
                                             "scalar reward.")
    length_penalty: float = Field(default=0.0, ge=0.0, description="Reward lost per completion token beyond "
                                  "length_target.")
    length_target: int = Field(default=0, ge=0)
    group_timeout_s: float = Field(default=30.0, gt=0, description="A group still missing verdicts this long "
                                   "after its first one is emitted incomplete.")

    # evaluation on held-out tasks
    eval_every: int = Field(default=20, ge=1, description="The evaluator scores policy version 0 and every "
                            "eval_every-th version on the held-out tasks.")
    eval_samples: int = Field(default=4, ge=0, le=64, description="Completions of each held-out task the evaluator "
                              "also draws at the training temperature, besides the greedy one: their pass rate, not "
                              "the greedy one, is what reward_without_heldout holds the training reward against "
                              "(0: greedy only, and the greedy rate is used).")

    # the policy update
    objective: str = Field(default="grpo", pattern="^(grpo|ppo|dpo)$")
    lr: float = Field(default=1e-3, gt=0, le=1.0)
    lr_decay_steps: int = Field(default=0, ge=0, description="Linear decay of the learning rate to 10% over "
                                "this many steps (0: constant).")
    lr_warmup_steps: int = Field(default=0, ge=0, description="Linear warm-up of the learning rate over the first "
                                 "this many steps (0: none): Adam's first steps, on moments estimated from a "
                                 "batch or two, are full-size steps in the direction of noise.")
    epochs: int = Field(default=1, ge=1, le=16, description="Optimiser passes over each batch.")
    clip_eps: float = Field(default=0.2, gt=0)
    kl_coef: float = Field(default=0.0, ge=0, description="Weight of the KL term to the frozen reference.")
    entropy_coef: float = Field(default=0.0, ge=0)
    max_grad_norm: float = Field(default=1.0, gt=0)
    dpo_beta: float = Field(default=0.1, gt=0)
    micro_batch_size: int = Field(default=0, ge=0, description="Samples per forward/backward pass; gradients "
                                  "accumulate over the step's batch (0: the whole batch at once).")
    gradient_checkpointing: bool = Field(default=False, description="Recompute activations in the backward pass "
                                         "(transformers models): less memory, more time.")
    lora_rank: int = Field(default=0, ge=0, description="Train LoRA adapters of this rank on every linear layer "
                           "instead of all weights (transformers models, through peft); 0: full fine-tuning. "
                           "Checkpoints hold the merged weights, so generators load plain folders.")
    lora_alpha: float = Field(default=16.0, gt=0, description="LoRA scaling numerator (the update is alpha/rank).")

    # the learner's processes
    learner_ranks: int = Field(default=1, ge=1, le=1024, description="Learner processes taking each step together "
                               "(torch.distributed; `crucible train` launches them with torchrun on this machine).")
    learner_sharding: str = Field(default="ddp", pattern="^(ddp|fsdp)$", description="ddp: every rank holds the "
                                  "whole model; fsdp: weights, gradients and optimiser state sharded across ranks "
                                  "(FSDP2), for a model one device cannot hold.")
    learner_optimizer_every: int = Field(default=10, ge=1, le=1_000_000, description="Versions between two writes "
                                         "of the optimiser state (1: with every version). Weights, offsets and the "
                                         "ids trained on go with every version; a learner resumed between two "
                                         "writes goes on from the newest weights with the newest optimiser state "
                                         "written (its Adam moments that many steps older), and trains no sample "
                                         "twice. The state is twice the weights: for a real model, most of what a "
                                         "version costs to write.")

    def environment(self) -> dict[str, str]:
        """These values as CRUCIBLE_* variables, for the services a run starts as processes."""
        out = {}
        for name, value in self.model_dump().items():
            if value is None:
                continue
            out[f"CRUCIBLE_{name.upper()}"] = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
        return out


class Settings(BaseSettings, RunConfig):
    """Where things run (brokers, stores, ports, limits) plus the run configuration."""

    # An error names the variable and what is wrong, never the value given (a URL's or a key's secret).
    model_config = SettingsConfigDict(env_prefix="CRUCIBLE_", extra="ignore", allow_inf_nan=False,
                                      hide_input_in_errors=True)

    home: Path = Field(
        default=Path.home() / ".cache" / "crucible",
        description="Where Kafka's jars, the local broker's and store's data, PID files and logs live.",
    )

    # Kafka
    kafka_bootstrap: str = "127.0.0.1:9092"
    kafka_version: str = "4.4.0"
    kafka_controller_port: int = 9093
    kafka_topic_partitions: int = Field(default=1, ge=1, le=10000, description="Partitions of each topic whose "
                                        "consumers scale out (bus.SCALED_TOPICS), when a service creates it: at "
                                        "least the most replicas any consumer group of it will run.")
    # Passed to every Kafka client (shared/bus.py, connection options; the aggregator's faust app too).
    kafka_security_protocol: str = Field(default="PLAINTEXT", pattern="^(PLAINTEXT|SSL|SASL_PLAINTEXT|SASL_SSL)$")
    kafka_sasl_mechanism: str = Field(default="PLAIN", pattern="^(PLAIN|SCRAM-SHA-256|SCRAM-SHA-512)$")
    kafka_sasl_username: str | None = None
    kafka_sasl_password: SecretStr | None = None
    kafka_ssl_cafile: Path | None = Field(default=None, description="PEM CA the brokers' certificates chain to.")
    topic_prefix: str = "crucible."
    consumer_group_prefix: str = "crucible-"
    instance_id: str = Field(default="", description="A name this service instance keeps across restarts and "
                             "shares with no other live instance (a StatefulSet pod's name; `crucible train` and "
                             "`crucible up` set it): its consumer groups then use static membership, so a "
                             "restarted instance takes its partitions back at once. Empty: dynamic membership.")

    # ClickHouse: the embedded chDB store by default, any ClickHouse server otherwise.
    clickhouse_url: str = Field(default="http://127.0.0.1:8123", description="http(s)://[user[:password]@]host[:port]")
    clickhouse_database: str = "crucible"
    clickhouse_user: str = "default"
    clickhouse_password: SecretStr | None = None

    @field_validator("clickhouse_url")
    @classmethod
    def _a_store_url(cls, url: str) -> str:
        """A URL every store client can connect to (a port out of range raised ValueError in each of them)."""
        parsed = urlparse(url)
        try:
            port = parsed.port
        except ValueError:
            raise ValueError("its port is not a number from 1 to 65535") from None
        if parsed.scheme not in ("http", "https") or not parsed.hostname or port == 0:
            raise ValueError("give http(s)://host[:port] (the store's HTTP interface)")
        return url

    # Trust: the key that signs tasks and seals sandbox results (shared/integrity.py); none: a key file
    # under CRUCIBLE_HOME that the first process creates.
    integrity_key: SecretStr | None = Field(default=None, description="Hex, at least 32 bytes; every service "
                                            "of a deployment must hold the same.")

    # gRPC: one port per service on one machine; a token and TLS where it listens beyond loopback (shared/rpc.py)
    grpc_host: str = "127.0.0.1"
    rpc_token: SecretStr | None = Field(default=None, description="Bearer token every gRPC server requires and "
                                        "every client sends; none: no check (loopback only).")
    rpc_tls_cert: Path | None = Field(default=None, description="PEM certificate the gRPC servers present.")
    rpc_tls_key: Path | None = Field(default=None, description="Its private key (PEM).")
    rpc_tls_ca: Path | None = Field(default=None, description="PEM CA (or certificate) clients trust: TLS on.")
    rpc_allow_insecure: bool = Field(default=False, description="Serve beyond loopback without a token.")
    control_grpc_port: int = 50051

    # sandbox-executor
    sandbox_grpc_port: int = 50053
    sandbox_workers: int = Field(default=0, ge=0, description="Pre-forked workers; 0 means one per core.")
    sandbox_queue_size: int = Field(default=0, ge=0, description="Jobs waiting beyond the workers; 0 means 4 per worker.")
    sandbox_allow_weak_isolation: bool = Field(
        default=False, description="Run even when some isolation primitive is missing (reported in every result).")
    sandbox_wall_s: float = Field(default=10.0, gt=0, le=600)
    sandbox_cpu_s: int = Field(default=5, ge=1, le=600)
    sandbox_memory_mb: int = Field(default=512, ge=64)
    sandbox_file_mb: int = Field(default=16, ge=1)
    sandbox_work_mb: int = Field(default=32, ge=1)
    sandbox_output_bytes: int = Field(default=64 * 1024, ge=1024)
    sandbox_processes: int = Field(default=32, ge=1)
    sandbox_open_files: int = Field(default=64, ge=16, description="Descriptors a job may hold (the jail's own "
                                    "eight and its seccomp listener among them).")
    sandbox_uid_base: int = Field(default=200_000, ge=1000, description="Workers run jobs as uids from this one "
                                  "up, each leased to one sandbox pool on the host (pool.UidLeases).")

    # generator
    generator_grpc_port: int = 50052
    generator_backend: str = Field(default="auto", pattern="^(auto|torch|hf|vllm)$", description="auto: the "
                                   "built-in policy in torch, any other checkpoint with transformers.")
    generator_batch_tasks: int = Field(default=16, ge=1, description="Tasks sampled together in one batch.")
    vllm_tensor_parallel: int = Field(default=1, ge=1, le=64, description="GPUs one vLLM generator shards the "
                                      "model across (tensor parallelism); the pod requests as many.")
    generator_batch_wait_ms: float = Field(default=20.0, ge=0.0, description="How long a batch waits to fill.")

    # verifier
    verifier_grpc_port: int = 50054
    verifier_sandbox_target: str = Field(
        default="127.0.0.1:50053",
        description="Sandbox gRPC address Verify uses for python_tests rollouts that arrive without an execution.")
    verifier_workers: int = Field(default=0, ge=0, description="Scoring processes; 0 means one per core.")
    verifier_score_timeout_s: float = Field(
        default=10.0, gt=0, le=600,
        description="Longest one completion may take to score; past it the scoring process is killed, reward 0.")

    # evaluator
    evaluator_verifier_target: str = Field(default="127.0.0.1:50054", description="The Verifier gRPC the "
                                           "evaluator scores held-out completions with.")

    # learner
    learner_grpc_port: int = 50055
    learner_keep_checkpoints: int = Field(default=5, ge=2)
    learner_collective_timeout_s: float = Field(default=600.0, gt=0, description="How long a learner rank waits "
                                                "in a collective for a rank that neither answers nor dies.")

    # Checkpoints beyond one filesystem: any fsspec URI (s3://, gs://, ...) besides local folders.
    checkpoint_base_uri: str | None = Field(
        default=None, description="Where the learner publishes checkpoints for generators on other machines "
        "(base_uri/<run_id>/v000123, optimizer state left behind); unset: the local run folder, file:// URIs.")
    checkpoint_storage_options: dict[str, str] = Field(
        default_factory=dict, description="fsspec options for remote checkpoint URIs (JSON), e.g. "
        '{"endpoint_url": "http://minio:9000", "key": "...", "secret": "..."}; generators need the same.')

    # Tasks
    instance: str = Field(default_factory=lambda: __import__("socket").gethostname(), description="Names this "
                          "replica of a service; stable across its restarts (a StatefulSet pod's name), unique "
                          "among replicas: the episode hops' Kafka transactions are fenced by it.")
    transaction_timeout_ms: int = Field(default=20_000, ge=1000, description="How long an open Kafka transaction "
                                        "of a replica that died may hold readers back before the broker aborts it.")
    max_group_size: int = Field(default=64, ge=1, description="Largest group a task may ask for.")
    max_prompt_chars: int = Field(default=32_000, ge=1)
    max_task_bytes: int = Field(default=1 << 20, ge=1024, le=8 << 20, description="A task's size, encoded, at "
                                "most: its checks (test code parsed and walked, about 5 s a MB) run only within "
                                "it. No built-in task comes near (a few KB); the sandbox takes no job over 8 MB.")

    # OpenTelemetry: OTLP export happens only when an endpoint is set.
    otel_endpoint: str | None = None
    otel_protocol: str = Field(default="grpc", pattern="^(grpc|http)$")
    detect_window: int = Field(default=256, ge=8, description="Verdicts per window of the aggregator's "
                               "reward-hacking detectors (services/reward_aggregator/detectors.py).")
    detect_tamper_rate: float = Field(default=0.05, gt=0, le=1, description="Share of forged passes in a window "
                                      "that raises tamper_rate.")
    detect_component_gain: float = Field(default=0.2, gt=0, description="Rise of a reward component's mean over "
                                         "the first window, without the solved share, that raises "
                                         "component_without_correctness.")
    detect_kl_limit: float = Field(default=3.0, gt=0, description="KL to the reference above which the learner "
                                   "raises kl_blowup (services/learner/monitors.py).")
    detect_entropy_floor: float = Field(default=0.01, ge=0, description="Mean token entropy below which the "
                                        "learner raises entropy_collapse, if the training reward has not "
                                        "risen detect_reward_gain since the run's first steps.")
    detect_reward_gain: float = Field(default=0.2, gt=0, description="Rise of the training reward, with a flat "
                                      "held-out pass rate, that raises reward_without_heldout.")
    detect_length_factor: float = Field(default=3.0, gt=1, description="Growth of the mean response length over "
                                        "the run's first steps that raises length_blowup.")
    detect_cooldown_s: float = Field(default=300.0, ge=0, description="Per-sample alerts (tamper, canary_passed): "
                                     "events of a kind less than this apart are one incident, one alert.")
    metrics_host: str = Field(default="127.0.0.1", description="Where each service serves Prometheus /metrics "
                              "(0.0.0.0 in a pod).")
    metrics_port: int = Field(default=9464, ge=0, le=65535, description="Its port; 0: any free port (logged, and "
                              "written to metrics_port_file).")
    metrics_port_file: Path | None = Field(default=None, description="Where a service writes the metrics port it got.")
    cpu_nice: int = Field(default=0, ge=0, le=19, description="How far below normal this service's CPU priority "
                          "is (Unix nice, applied to the whole process as it starts). `crucible train` and "
                          "`crucible up` lower the evaluator's, whose work no policy step waits for.")
    malloc_keep_freed: bool = Field(default=True, description="Keep memory this service frees for its next "
                                    "allocations (one malloc arena, no trimming, no mmap per tensor) instead of "
                                    "giving it back to the system and faulting it in again; turn off where a "
                                    "service's peak memory must be returned between its peaks.")
    otel_store_spans: bool = Field(default=True, description="Write every span into the store's otel_traces "
                                   "table (the embedded setup); turn off where a collector writes them.")
    otel_trace_ratio: float = Field(default=0.125, ge=0, le=1, description="The share of traces kept (head "
                                    "sampling, decided where a trace begins, such as a task's publication, and "
                                    "followed by every service): 1 keeps every sample's trace. Tracing every "
                                    "sample of the built-in recipe took about 15% of a step's CPU here. "
                                    "OTEL_TRACES_SAMPLER, where set, decides instead.")
    otel_span_file: Path | None = Field(default=None, description="Also append every finished span to this "
                                        "file, one JSON object a line (for looking at a run without a collector).")

    log_level: str = "INFO"

    def run_config(self) -> RunConfig:
        """The run configuration part of these settings."""
        return RunConfig(**{name: getattr(self, name) for name in RunConfig.model_fields})

    def topic(self, name: str) -> str:
        """Full topic name for a short one: topic('tasks') -> 'crucible.tasks'."""
        return name if name.startswith(self.topic_prefix) else self.topic_prefix + name

    @property
    def kafka_host_port(self) -> tuple[str, int]:
        host, _, port = self.kafka_bootstrap.split(",")[0].rpartition(":")
        return host, int(port)


@functools.lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
