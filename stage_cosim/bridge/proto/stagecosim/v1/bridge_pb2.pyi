from google.protobuf import any_pb2 as _any_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    QUEUED: _ClassVar[JobState]
    RUNNING: _ClassVar[JobState]
    SUCCEEDED: _ClassVar[JobState]
    FAILED: _ClassVar[JobState]
    CANCELLING: _ClassVar[JobState]
    CANCELLED: _ClassVar[JobState]
JOB_STATE_UNSPECIFIED: JobState
QUEUED: JobState
RUNNING: JobState
SUCCEEDED: JobState
FAILED: JobState
CANCELLING: JobState
CANCELLED: JobState

class Design(_message.Message):
    __slots__ = ("model", "model_config", "layers", "hidden", "ffn", "heads", "kv_heads", "head_dim", "vocab", "max_seq", "attention", "causal_flops", "cross_entropy", "dp", "tp", "pp", "vp", "sp", "micro_batch", "global_batch", "seq_len", "zero", "recompute", "schedule", "pp_layers", "axis_order", "dtype", "tp_comm_overlap", "overlap_param_gather", "grad_reduce_dtype", "overlap_grad_reduce", "software", "ep", "expert_tp", "moe_token_dispatcher", "moe_capacity_factor", "moe_pad_to_capacity", "moe_imbalance", "moe_shared_expert_overlap", "phase", "batch", "input_len", "context_len", "kv_cache_dtype", "weight_dtype", "attention_dp", "fp8_activation_scale", "two_batch_overlap", "cluster", "cluster_description", "network_model", "backend", "fp8_recipe", "fp8_format", "fp8_attention", "fp8_param_gather", "fp8_dispatch", "fp8_amax_history_len", "te_layernorm_mlp", "cp", "cp_comm", "cp_a2a_size", "cp_load_balance")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    FFN_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    CAUSAL_FLOPS_FIELD_NUMBER: _ClassVar[int]
    CROSS_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    VP_FIELD_NUMBER: _ClassVar[int]
    SP_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    ZERO_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    PP_LAYERS_FIELD_NUMBER: _ClassVar[int]
    AXIS_ORDER_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TP_COMM_OVERLAP_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_PARAM_GATHER_FIELD_NUMBER: _ClassVar[int]
    GRAD_REDUCE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_GRAD_REDUCE_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_FIELD_NUMBER: _ClassVar[int]
    EP_FIELD_NUMBER: _ClassVar[int]
    EXPERT_TP_FIELD_NUMBER: _ClassVar[int]
    MOE_TOKEN_DISPATCHER_FIELD_NUMBER: _ClassVar[int]
    MOE_CAPACITY_FACTOR_FIELD_NUMBER: _ClassVar[int]
    MOE_PAD_TO_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    MOE_IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    MOE_SHARED_EXPERT_OVERLAP_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    INPUT_LEN_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_DP_FIELD_NUMBER: _ClassVar[int]
    FP8_ACTIVATION_SCALE_FIELD_NUMBER: _ClassVar[int]
    TWO_BATCH_OVERLAP_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    NETWORK_MODEL_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    FP8_RECIPE_FIELD_NUMBER: _ClassVar[int]
    FP8_FORMAT_FIELD_NUMBER: _ClassVar[int]
    FP8_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    FP8_PARAM_GATHER_FIELD_NUMBER: _ClassVar[int]
    FP8_DISPATCH_FIELD_NUMBER: _ClassVar[int]
    FP8_AMAX_HISTORY_LEN_FIELD_NUMBER: _ClassVar[int]
    TE_LAYERNORM_MLP_FIELD_NUMBER: _ClassVar[int]
    CP_FIELD_NUMBER: _ClassVar[int]
    CP_COMM_FIELD_NUMBER: _ClassVar[int]
    CP_A2A_SIZE_FIELD_NUMBER: _ClassVar[int]
    CP_LOAD_BALANCE_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_config: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_seq: int
    attention: str
    causal_flops: bool
    cross_entropy: str
    dp: int
    tp: int
    pp: int
    vp: int
    sp: bool
    micro_batch: int
    global_batch: int
    seq_len: int
    zero: int
    recompute: str
    schedule: str
    pp_layers: _containers.RepeatedScalarFieldContainer[int]
    axis_order: _containers.RepeatedScalarFieldContainer[str]
    dtype: str
    tp_comm_overlap: bool
    overlap_param_gather: bool
    grad_reduce_dtype: str
    overlap_grad_reduce: bool
    software: str
    ep: int
    expert_tp: int
    moe_token_dispatcher: str
    moe_capacity_factor: float
    moe_pad_to_capacity: bool
    moe_imbalance: float
    moe_shared_expert_overlap: bool
    phase: str
    batch: int
    input_len: int
    context_len: int
    kv_cache_dtype: str
    weight_dtype: str
    attention_dp: bool
    fp8_activation_scale: str
    two_batch_overlap: bool
    cluster: str
    cluster_description: str
    network_model: str
    backend: str
    fp8_recipe: str
    fp8_format: str
    fp8_attention: bool
    fp8_param_gather: bool
    fp8_dispatch: bool
    fp8_amax_history_len: int
    te_layernorm_mlp: bool
    cp: int
    cp_comm: str
    cp_a2a_size: int
    cp_load_balance: bool
    def __init__(self, model: _Optional[str] = ..., model_config: _Optional[str] = ..., layers: _Optional[int] = ..., hidden: _Optional[int] = ..., ffn: _Optional[int] = ..., heads: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., vocab: _Optional[int] = ..., max_seq: _Optional[int] = ..., attention: _Optional[str] = ..., causal_flops: _Optional[bool] = ..., cross_entropy: _Optional[str] = ..., dp: _Optional[int] = ..., tp: _Optional[int] = ..., pp: _Optional[int] = ..., vp: _Optional[int] = ..., sp: _Optional[bool] = ..., micro_batch: _Optional[int] = ..., global_batch: _Optional[int] = ..., seq_len: _Optional[int] = ..., zero: _Optional[int] = ..., recompute: _Optional[str] = ..., schedule: _Optional[str] = ..., pp_layers: _Optional[_Iterable[int]] = ..., axis_order: _Optional[_Iterable[str]] = ..., dtype: _Optional[str] = ..., tp_comm_overlap: _Optional[bool] = ..., overlap_param_gather: _Optional[bool] = ..., grad_reduce_dtype: _Optional[str] = ..., overlap_grad_reduce: _Optional[bool] = ..., software: _Optional[str] = ..., ep: _Optional[int] = ..., expert_tp: _Optional[int] = ..., moe_token_dispatcher: _Optional[str] = ..., moe_capacity_factor: _Optional[float] = ..., moe_pad_to_capacity: _Optional[bool] = ..., moe_imbalance: _Optional[float] = ..., moe_shared_expert_overlap: _Optional[bool] = ..., phase: _Optional[str] = ..., batch: _Optional[int] = ..., input_len: _Optional[int] = ..., context_len: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., weight_dtype: _Optional[str] = ..., attention_dp: _Optional[bool] = ..., fp8_activation_scale: _Optional[str] = ..., two_batch_overlap: _Optional[bool] = ..., cluster: _Optional[str] = ..., cluster_description: _Optional[str] = ..., network_model: _Optional[str] = ..., backend: _Optional[str] = ..., fp8_recipe: _Optional[str] = ..., fp8_format: _Optional[str] = ..., fp8_attention: _Optional[bool] = ..., fp8_param_gather: _Optional[bool] = ..., fp8_dispatch: _Optional[bool] = ..., fp8_amax_history_len: _Optional[int] = ..., te_layernorm_mlp: _Optional[bool] = ..., cp: _Optional[int] = ..., cp_comm: _Optional[str] = ..., cp_a2a_size: _Optional[int] = ..., cp_load_balance: _Optional[bool] = ...) -> None: ...

class SimulateJob(_message.Message):
    __slots__ = ("design", "traces_upload", "full", "timeline")
    DESIGN_FIELD_NUMBER: _ClassVar[int]
    TRACES_UPLOAD_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    design: Design
    traces_upload: str
    full: bool
    timeline: bool
    def __init__(self, design: _Optional[_Union[Design, _Mapping]] = ..., traces_upload: _Optional[str] = ..., full: _Optional[bool] = ..., timeline: _Optional[bool] = ...) -> None: ...

class SynthJob(_message.Message):
    __slots__ = ("design", "format")
    DESIGN_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    design: Design
    format: str
    def __init__(self, design: _Optional[_Union[Design, _Mapping]] = ..., format: _Optional[str] = ...) -> None: ...

class SearchJob(_message.Message):
    __slots__ = ("design", "settings_json")
    DESIGN_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_JSON_FIELD_NUMBER: _ClassVar[int]
    design: Design
    settings_json: str
    def __init__(self, design: _Optional[_Union[Design, _Mapping]] = ..., settings_json: _Optional[str] = ...) -> None: ...

class ServeSimJob(_message.Message):
    __slots__ = ("design", "settings_json")
    DESIGN_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_JSON_FIELD_NUMBER: _ClassVar[int]
    design: Design
    settings_json: str
    def __init__(self, design: _Optional[_Union[Design, _Mapping]] = ..., settings_json: _Optional[str] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("request_id", "timeout_s", "no_cache", "simulate", "synthesize", "optimize", "explore", "serve_sim")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    NO_CACHE_FIELD_NUMBER: _ClassVar[int]
    SIMULATE_FIELD_NUMBER: _ClassVar[int]
    SYNTHESIZE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZE_FIELD_NUMBER: _ClassVar[int]
    EXPLORE_FIELD_NUMBER: _ClassVar[int]
    SERVE_SIM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    timeout_s: float
    no_cache: bool
    simulate: SimulateJob
    synthesize: SynthJob
    optimize: SearchJob
    explore: SearchJob
    serve_sim: ServeSimJob
    def __init__(self, request_id: _Optional[str] = ..., timeout_s: _Optional[float] = ..., no_cache: _Optional[bool] = ..., simulate: _Optional[_Union[SimulateJob, _Mapping]] = ..., synthesize: _Optional[_Union[SynthJob, _Mapping]] = ..., optimize: _Optional[_Union[SearchJob, _Mapping]] = ..., explore: _Optional[_Union[SearchJob, _Mapping]] = ..., serve_sim: _Optional[_Union[ServeSimJob, _Mapping]] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id", "after_seq", "heartbeat_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    after_seq: int
    heartbeat_s: float
    def __init__(self, job_id: _Optional[str] = ..., after_seq: _Optional[int] = ..., heartbeat_s: _Optional[float] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("done", "total", "detail_json", "best_json")
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    DETAIL_JSON_FIELD_NUMBER: _ClassVar[int]
    BEST_JSON_FIELD_NUMBER: _ClassVar[int]
    done: int
    total: int
    detail_json: str
    best_json: str
    def __init__(self, done: _Optional[int] = ..., total: _Optional[int] = ..., detail_json: _Optional[str] = ..., best_json: _Optional[str] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("id", "kind", "state", "request_id", "digest", "created_at", "started_at", "finished_at", "timeout_s", "progress", "result_json", "result_size", "error", "error_parameter", "log_excerpt", "cached", "last_seq", "request_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    RESULT_SIZE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_PARAMETER_FIELD_NUMBER: _ClassVar[int]
    LOG_EXCERPT_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    REQUEST_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    kind: str
    state: JobState
    request_id: str
    digest: str
    created_at: float
    started_at: float
    finished_at: float
    timeout_s: float
    progress: Progress
    result_json: str
    result_size: int
    error: str
    error_parameter: str
    log_excerpt: _containers.RepeatedScalarFieldContainer[str]
    cached: bool
    last_seq: int
    request_json: str
    def __init__(self, id: _Optional[str] = ..., kind: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., request_id: _Optional[str] = ..., digest: _Optional[str] = ..., created_at: _Optional[float] = ..., started_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., timeout_s: _Optional[float] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., result_json: _Optional[str] = ..., result_size: _Optional[int] = ..., error: _Optional[str] = ..., error_parameter: _Optional[str] = ..., log_excerpt: _Optional[_Iterable[str]] = ..., cached: _Optional[bool] = ..., last_seq: _Optional[int] = ..., request_json: _Optional[str] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("seq", "time", "job_id", "state", "progress", "log", "heartbeat")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    time: float
    job_id: str
    state: StateChange
    progress: Progress
    log: LogLine
    heartbeat: Heartbeat
    def __init__(self, seq: _Optional[int] = ..., time: _Optional[float] = ..., job_id: _Optional[str] = ..., state: _Optional[_Union[StateChange, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., log: _Optional[_Union[LogLine, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ...) -> None: ...

class StateChange(_message.Message):
    __slots__ = ("state", "message", "job")
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    state: JobState
    message: str
    job: Job
    def __init__(self, state: _Optional[_Union[JobState, str]] = ..., message: _Optional[str] = ..., job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class LogLine(_message.Message):
    __slots__ = ("stream", "line")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    stream: str
    line: str
    def __init__(self, stream: _Optional[str] = ..., line: _Optional[str] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: JobState
    def __init__(self, state: _Optional[_Union[JobState, str]] = ...) -> None: ...

class FileSpec(_message.Message):
    __slots__ = ("path", "size", "sha256")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    sha256: str
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class UploadHeader(_message.Message):
    __slots__ = ("files",)
    FILES_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[FileSpec]
    def __init__(self, files: _Optional[_Iterable[_Union[FileSpec, _Mapping]]] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("path", "offset", "data")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    data: bytes
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class UploadTracesRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: UploadHeader
    chunk: FileChunk
    def __init__(self, header: _Optional[_Union[UploadHeader, _Mapping]] = ..., chunk: _Optional[_Union[FileChunk, _Mapping]] = ...) -> None: ...

class Upload(_message.Message):
    __slots__ = ("upload_id", "files", "total_bytes", "sha256")
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    files: _containers.RepeatedCompositeFieldContainer[FileSpec]
    total_bytes: int
    sha256: str
    def __init__(self, upload_id: _Optional[str] = ..., files: _Optional[_Iterable[_Union[FileSpec, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class ListArtifactsRequest(_message.Message):
    __slots__ = ("job_id", "upload_id", "prefix", "page_size", "page_token")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    upload_id: str
    prefix: str
    page_size: int
    page_token: str
    def __init__(self, job_id: _Optional[str] = ..., upload_id: _Optional[str] = ..., prefix: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListArtifactsResponse(_message.Message):
    __slots__ = ("files", "next_page_token")
    FILES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[FileSpec]
    next_page_token: str
    def __init__(self, files: _Optional[_Iterable[_Union[FileSpec, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DownloadRequest(_message.Message):
    __slots__ = ("job_id", "upload_id", "path", "offset")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    upload_id: str
    path: str
    offset: int
    def __init__(self, job_id: _Optional[str] = ..., upload_id: _Optional[str] = ..., path: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class DownloadChunk(_message.Message):
    __slots__ = ("path", "offset", "data", "size", "sha256")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    data: bytes
    size: int
    sha256: str
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("version", "job_kinds", "workers", "max_queue", "queued", "running", "max_upload_bytes", "default_timeout_s", "max_timeout_s", "draining", "jobs", "cache_entries", "max_job_memory_bytes", "job_cpu_s", "max_request_bytes", "search_workers")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    JOB_KINDS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_UPLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    CACHE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    MAX_JOB_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    JOB_CPU_S_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEARCH_WORKERS_FIELD_NUMBER: _ClassVar[int]
    version: str
    job_kinds: _containers.RepeatedScalarFieldContainer[str]
    workers: int
    max_queue: int
    queued: int
    running: int
    max_upload_bytes: int
    default_timeout_s: float
    max_timeout_s: float
    draining: bool
    jobs: int
    cache_entries: int
    max_job_memory_bytes: int
    job_cpu_s: float
    max_request_bytes: int
    search_workers: int
    def __init__(self, version: _Optional[str] = ..., job_kinds: _Optional[_Iterable[str]] = ..., workers: _Optional[int] = ..., max_queue: _Optional[int] = ..., queued: _Optional[int] = ..., running: _Optional[int] = ..., max_upload_bytes: _Optional[int] = ..., default_timeout_s: _Optional[float] = ..., max_timeout_s: _Optional[float] = ..., draining: _Optional[bool] = ..., jobs: _Optional[int] = ..., cache_entries: _Optional[int] = ..., max_job_memory_bytes: _Optional[int] = ..., job_cpu_s: _Optional[float] = ..., max_request_bytes: _Optional[int] = ..., search_workers: _Optional[int] = ...) -> None: ...

class ErrorDetail(_message.Message):
    __slots__ = ("reason", "field", "description", "retry_after_s")
    REASON_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    reason: str
    field: str
    description: str
    retry_after_s: float
    def __init__(self, reason: _Optional[str] = ..., field: _Optional[str] = ..., description: _Optional[str] = ..., retry_after_s: _Optional[float] = ...) -> None: ...

class RpcStatus(_message.Message):
    __slots__ = ("code", "message", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    details: _containers.RepeatedCompositeFieldContainer[_any_pb2.Any]
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., details: _Optional[_Iterable[_Union[_any_pb2.Any, _Mapping]]] = ...) -> None: ...
