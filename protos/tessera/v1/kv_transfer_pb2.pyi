from tessera.protos.tessera.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PullBlocksRequest(_message.Message):
    __slots__ = ("version", "request_id", "prompt_token_ids", "sampling", "seed", "cache_salt", "skip_blocks", "block_size", "model_fingerprint", "max_chunk_bytes", "lora_name", "lora_path", "lora_digest")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    LORA_DIGEST_FIELD_NUMBER: _ClassVar[int]
    version: int
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingOptions
    seed: int
    cache_salt: str
    skip_blocks: int
    block_size: int
    model_fingerprint: str
    max_chunk_bytes: int
    lora_name: str
    lora_path: str
    lora_digest: str
    def __init__(self, version: _Optional[int] = ..., request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingOptions, _Mapping]] = ..., seed: _Optional[int] = ..., cache_salt: _Optional[str] = ..., skip_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., max_chunk_bytes: _Optional[int] = ..., lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., lora_digest: _Optional[str] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("block_index", "layer_start", "layer_end", "dtype", "shape", "data", "crc32", "num_layers")
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    block_index: int
    layer_start: int
    layer_end: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    crc32: int
    num_layers: int
    def __init__(self, block_index: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., num_layers: _Optional[int] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: _generation_pb2.TokenLogprob
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[_Union[_generation_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...

class PullBlocksResponse(_message.Message):
    __slots__ = ("version", "chunk", "first_token")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    version: int
    chunk: KVChunk
    first_token: FirstToken
    def __init__(self, version: _Optional[int] = ..., chunk: _Optional[_Union[KVChunk, _Mapping]] = ..., first_token: _Optional[_Union[FirstToken, _Mapping]] = ...) -> None: ...
