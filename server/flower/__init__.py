"""The Flower side of the server (layer above the server core): the ServerApp (``app``), the transport that
runs the engine's queries over Flower messages (``transport``) and SecAgg+ rounds (``secagg``). Only this
package, ``dpdro.client.flower`` and ``dpdro.common.flower`` import ``flwr`` (CONTRIBUTING.md)."""
