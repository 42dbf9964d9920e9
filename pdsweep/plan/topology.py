"""Tensor-parallel topology of a PD pair, as vLLM's ``TransferTopology`` sees it
(``kv_connector/utils.py``): the signed TP ratio and which prefill ranks a decode rank
talks to. A leaf: the plan rules, the cell model and the read plans all use it."""

from __future__ import annotations


def tp_ratio(prefill_tp: int, decode_tp: int) -> int:
    """vLLM's ``tp_ratio`` seen from the decode (local) side.

    ``decode_tp // prefill_tp`` (> 0) when decode TP >= prefill TP, else
    ``-(prefill_tp // decode_tp)`` (< 0). Mirrors ``TransferTopology.tp_ratio``
    (``kv_connector/utils.py``). Raises ``ValueError`` when the larger TP is not a
    multiple of the smaller (vLLM asserts).
    """
    hi, lo = max(prefill_tp, decode_tp), min(prefill_tp, decode_tp)
    if hi % lo:
        raise ValueError(f"TP {hi} is not a multiple of TP {lo}")
    return decode_tp // prefill_tp if decode_tp >= prefill_tp else -(prefill_tp // decode_tp)


def handshake_ranks(decode_tp: int, prefill_tp: int, decode_rank: int) -> list[int]:
    """Prefill ranks decode rank ``decode_rank`` handshakes with (vLLM
    ``TransferTopology.handshake_target_ranks``, no DCP)."""
    ratio = tp_ratio(prefill_tp, decode_tp)
    if ratio > 0:
        return [decode_rank // ratio]
    return [decode_rank * -ratio + i for i in range(-ratio)]
