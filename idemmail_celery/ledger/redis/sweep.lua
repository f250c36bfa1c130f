-- Runs after prelude.lua. A shelf's dead entries dropped now (``ledger purge --expired``), rather than
-- at the next completion writing onto it. KEYS: the shelf. ARGV: none. Returns how many went.
return sweep(KEYS[1], math.floor(now() / 1000))
