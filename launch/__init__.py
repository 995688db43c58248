"""Launch and operations tooling (imported as dpdro.launch): ``flwr run`` on the simulation engine
(``simulate``), certificates for a deployment (``certs``) and the loopback deployment (``deploy``). Above the
Flower apps in the layers: it starts them as processes and never imports them."""
