"""`make_quant_method`: a parsed `quantization_config` -> its `QuantMethod`."""

from __future__ import annotations

from moestream.config.quantization import QuantizationConfig
from moestream.quantization.compressed_tensors import CompressedTensorsMethod
from moestream.quantization.fp8 import Fp8Method
from moestream.quantization.gptq import GPTQMethod
from moestream.quantization.method import QuantMethod
from moestream.quantization.mxfp4 import MXFP4Method


def make_quant_method(config: QuantizationConfig) -> QuantMethod:
    """The `QuantMethod` of a parsed `quantization_config` (`config.method`).

    Raises:
        ValueError: FP8 weights on a torch build without float8_e4m3fn (`check_float8`).
    """
    if config.method == "fp8":
        return Fp8Method(config)
    if config.method == "compressed-tensors":
        return CompressedTensorsMethod(config)
    if config.method == "gptq":
        return GPTQMethod(config)
    return MXFP4Method(config)
