from crucible.v1 import task_pb2 as _task_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitTasksRequest(_message.Message):
    __slots__ = ("tasks",)
    TASKS_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[_task_pb2.Task]
    def __init__(self, tasks: _Optional[_Iterable[_Union[_task_pb2.Task, _Mapping]]] = ...) -> None: ...

class SubmitTasksResponse(_message.Message):
    __slots__ = ("task_ids",)
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    task_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, task_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RunStatusRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class RunStatus(_message.Message):
    __slots__ = ("run_id", "policy_version", "step", "tasks_submitted", "trajectories", "reward_mean", "pass_rate", "consumer_lag")
    class ConsumerLagEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TASKS_SUBMITTED_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    PASS_RATE_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_LAG_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    policy_version: int
    step: int
    tasks_submitted: int
    trajectories: int
    reward_mean: float
    pass_rate: float
    consumer_lag: _containers.ScalarMap[str, int]
    def __init__(self, run_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., step: _Optional[int] = ..., tasks_submitted: _Optional[int] = ..., trajectories: _Optional[int] = ..., reward_mean: _Optional[float] = ..., pass_rate: _Optional[float] = ..., consumer_lag: _Optional[_Mapping[str, int]] = ...) -> None: ...

class QueryTrajectoriesRequest(_message.Message):
    __slots__ = ("run_id", "task_id", "group_id", "min_policy_version", "limit", "page_token")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    task_id: str
    group_id: str
    min_policy_version: int
    limit: int
    page_token: str
    def __init__(self, run_id: _Optional[str] = ..., task_id: _Optional[str] = ..., group_id: _Optional[str] = ..., min_policy_version: _Optional[int] = ..., limit: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class TrajectoryRow(_message.Message):
    __slots__ = ("trajectory_id", "task_id", "group_id", "sample_index", "task_kind", "policy_version", "completion", "reward", "advantage")
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TASK_KIND_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    task_id: str
    group_id: str
    sample_index: int
    task_kind: str
    policy_version: int
    completion: str
    reward: float
    advantage: float
    def __init__(self, trajectory_id: _Optional[str] = ..., task_id: _Optional[str] = ..., group_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., task_kind: _Optional[str] = ..., policy_version: _Optional[int] = ..., completion: _Optional[str] = ..., reward: _Optional[float] = ..., advantage: _Optional[float] = ...) -> None: ...

class QueryTrajectoriesResponse(_message.Message):
    __slots__ = ("rows", "next_page_token")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[TrajectoryRow]
    next_page_token: str
    def __init__(self, rows: _Optional[_Iterable[_Union[TrajectoryRow, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...
