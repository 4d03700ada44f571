import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PolicyVersion(_message.Message):
    __slots__ = ("run_id", "version", "checkpoint_uri", "step", "metrics", "created_at", "checkpoint_sha256", "signature")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_URI_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SHA256_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    version: int
    checkpoint_uri: str
    step: int
    metrics: StepMetrics
    created_at: _timestamp_pb2.Timestamp
    checkpoint_sha256: str
    signature: bytes
    def __init__(self, run_id: _Optional[str] = ..., version: _Optional[int] = ..., checkpoint_uri: _Optional[str] = ..., step: _Optional[int] = ..., metrics: _Optional[_Union[StepMetrics, _Mapping]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., checkpoint_sha256: _Optional[str] = ..., signature: _Optional[bytes] = ...) -> None: ...

class StepMetrics(_message.Message):
    __slots__ = ("loss", "kl", "entropy", "grad_norm", "reward_mean", "pass_rate", "samples", "dropped_stale", "step_ms", "learning_rate", "mismatch_kl", "skipped")
    class SkippedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    LOSS_FIELD_NUMBER: _ClassVar[int]
    KL_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    PASS_RATE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_KL_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    loss: float
    kl: float
    entropy: float
    grad_norm: float
    reward_mean: float
    pass_rate: float
    samples: int
    dropped_stale: int
    step_ms: float
    learning_rate: float
    mismatch_kl: float
    skipped: _containers.ScalarMap[str, int]
    def __init__(self, loss: _Optional[float] = ..., kl: _Optional[float] = ..., entropy: _Optional[float] = ..., grad_norm: _Optional[float] = ..., reward_mean: _Optional[float] = ..., pass_rate: _Optional[float] = ..., samples: _Optional[int] = ..., dropped_stale: _Optional[int] = ..., step_ms: _Optional[float] = ..., learning_rate: _Optional[float] = ..., mismatch_kl: _Optional[float] = ..., skipped: _Optional[_Mapping[str, int]] = ...) -> None: ...

class GetPolicyRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...
