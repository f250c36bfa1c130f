"""A deterministic simulator for idemmail-celery's guarantee (issue 36).

It drives the real, Celery-free :class:`~idemmail_celery.handler.Handler` and the real campaign
code (:func:`idemmail_celery.bulk.send_batch` and ``_send_campaign``) in one thread. Every delivery,
campaign pass, sweep and operator action runs in a greenlet of its own and hands control back to
the scheduler at each ledger call, provider call, publish and ack, where the scheduler may also
inject a fault, a crash, a stall, a broker copy or a step of the clock. See docs/guarantee.md
("What the simulator explores") for the bounds, the faults and the invariants.

Run it with ``python -m sim`` (``make sim``); ``sim.world`` is the model, ``sim.explore`` the
scheduler, ``sim.defects`` the planted defects its own tests require it to catch.
"""
