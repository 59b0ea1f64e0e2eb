"""sd-scripts' networks.lokr (LoKr) as a kohya network module (see networks/loha_lokr.py for the
network_args and networks/adapter_modules.py LoKrModule for the tensors)."""
from __future__ import annotations

from typing import Any, Optional

from networks import loha_lokr

MODULE = "networks.lokr"


def check_network_args(kwargs: dict[str, Any]) -> None:
    loha_lokr.check_network_args(MODULE, kwargs)


def create_network(multiplier: float, network_dim: Optional[int], network_alpha: Optional[float], vae,
                   text_encoder, unet, neuron_dropout: Optional[float] = None, **kwargs):
    return loha_lokr.create_network(MODULE, multiplier, network_dim, network_alpha, text_encoder, unet,
                                    neuron_dropout, kwargs)


def create_network_from_weights(multiplier: float, file: Optional[str], vae, text_encoder, unet, weights_sd=None,
                                for_inference: bool = False, **kwargs):
    return loha_lokr.create_network_from_weights(MODULE, multiplier, file, text_encoder, unet, weights_sd, kwargs)
