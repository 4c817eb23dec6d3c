"""PD transfer interfaces: KVArgs, KVPoll and the manager / sender / receiver ABCs."""

from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    DisaggregationMode,
    IncompatiblePeerError,
    KVArgs,
    KVPoll,
    KVTransferError,
    StateType,
    TransferConfig,
    UntrustedPeerError,
)

__all__ = [
    "BaseKVBootstrapServer",
    "BaseKVManager",
    "BaseKVReceiver",
    "BaseKVSender",
    "DisaggregationMode",
    "IncompatiblePeerError",
    "KVArgs",
    "KVPoll",
    "KVTransferError",
    "StateType",
    "TransferConfig",
    "UntrustedPeerError",
]
