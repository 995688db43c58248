"""Launch and operations tooling (imported as dpdro.launch): ``flwr run`` on the simulation engine
(``simulate``), certificates for a deployment (``certs``), the loopback deployment (``deploy``), the Fleet-only
gateway in front of the SuperLink (``fleet_gateway``) and the bookkeeping of the processes they start
(``processes``). Above the Flower apps in the layers: it starts them as processes and never imports them."""
