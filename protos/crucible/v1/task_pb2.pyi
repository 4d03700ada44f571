import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Task(_message.Message):
    __slots__ = ("id", "kind", "prompt", "python_tests", "answer", "generator", "environment", "group_size", "metadata", "created_at", "split", "signature", "min_policy_version")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PYTHON_TESTS_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    id: str
    kind: str
    prompt: str
    python_tests: PythonTests
    answer: ExpectedAnswer
    generator: GeneratorSpec
    environment: EnvironmentSpec
    group_size: int
    metadata: _containers.ScalarMap[str, str]
    created_at: _timestamp_pb2.Timestamp
    split: str
    signature: bytes
    min_policy_version: int
    def __init__(self, id: _Optional[str] = ..., kind: _Optional[str] = ..., prompt: _Optional[str] = ..., python_tests: _Optional[_Union[PythonTests, _Mapping]] = ..., answer: _Optional[_Union[ExpectedAnswer, _Mapping]] = ..., generator: _Optional[_Union[GeneratorSpec, _Mapping]] = ..., environment: _Optional[_Union[EnvironmentSpec, _Mapping]] = ..., group_size: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., split: _Optional[str] = ..., signature: _Optional[bytes] = ..., min_policy_version: _Optional[int] = ...) -> None: ...

class PythonTests(_message.Message):
    __slots__ = ("entry_point", "test_code", "language", "timeout_s")
    ENTRY_POINT_FIELD_NUMBER: _ClassVar[int]
    TEST_CODE_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    entry_point: str
    test_code: str
    language: str
    timeout_s: float
    def __init__(self, entry_point: _Optional[str] = ..., test_code: _Optional[str] = ..., language: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class ExpectedAnswer(_message.Message):
    __slots__ = ("answer", "case_sensitive")
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    CASE_SENSITIVE_FIELD_NUMBER: _ClassVar[int]
    answer: str
    case_sensitive: bool
    def __init__(self, answer: _Optional[str] = ..., case_sensitive: _Optional[bool] = ...) -> None: ...

class GeneratorSpec(_message.Message):
    __slots__ = ("name", "seed", "config_json", "entry_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    ENTRY_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    seed: int
    config_json: str
    entry_json: str
    def __init__(self, name: _Optional[str] = ..., seed: _Optional[int] = ..., config_json: _Optional[str] = ..., entry_json: _Optional[str] = ...) -> None: ...

class EnvironmentSpec(_message.Message):
    __slots__ = ("instance_json", "max_turns", "max_tokens")
    INSTANCE_JSON_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    instance_json: str
    max_turns: int
    max_tokens: int
    def __init__(self, instance_json: _Optional[str] = ..., max_turns: _Optional[int] = ..., max_tokens: _Optional[int] = ...) -> None: ...
