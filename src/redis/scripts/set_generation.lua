-- set_generation: writes a pool's Redis generation, never lowering it: an instance that stalled (past its rebuild
-- lease) must not put back a generation older than the one a newer rebuild wrote, or every hold taken since would
-- carry a generation Postgres no longer accepts.
-- A new pool's key is first written pending ("p<Redis ms>"), which reserve and add_free take for no generation: the
-- creating instance cannot tell a Redis wiped since it checked the marker from one that was not (the pool has no
-- keys in either), and an old generation written into a wiped Redis would let holds be taken that the rebuild's bump
-- then fences, though nobody else took their items. It finalizes the key (below) with the generation Postgres has
-- once it has seen the rebuilt-marker since its writes: a wipe after that is one the generation bump answers.
-- ARGV: 1 base, 2 generation, 3 mode: "always" (a rebuild in a new generation), "ifPresent" (a rebuild in the current
--       generation: a missing key means Redis was wiped since; a pending key is left to its pool's creator, unless it
--       is older than ARGV 5 ms: that creator died or stalled, and the rebuild finalizes it), "pending" (a new pool,
--       before and after its insert: written if missing), "finalize" (a new pool: only over its pending key),
--       "finalizeStale" (only over a pending key older than ARGV 5 ms: its creator died or stalled; -1 if younger, 2 if
--       there is no key),
--       4 with "always", the rebuild round that put the pool's Idempotency-Keys back (<base>kr, see RebuildService):
--       gone, Redis was wiped since, and with it the keys; the generation is not written, so that no reserve there
--       makes a second reservation for a key not back yet, 5 with "ifPresent" and "finalizeStale", after how long a
--       pending key is stale
-- Returns: 1 if the key now holds the generation (or is pending, for "pending", and for "ifPresent" while its creator
--          may still finalize it), 0 if it was left as it was
local base, generation, mode, keys_round = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4] or ''
local key = base .. 'gen'
local current = redis.call('GET', key)
local pending_since = current and string.match(current, '^p(%d+)$')
if mode == 'pending' then
  if current and not pending_since then return 0 end
  if not current then redis.call('SET', key, 'p' .. now_ms()) end
  return 1
end
if mode == 'finalize' and not pending_since then return 0 end
if mode == 'finalizeStale' then
  if not current then return 2 end
  if not pending_since then return 0 end
  if now_ms() - tonumber(pending_since) <= tonumber(ARGV[5]) then return -1 end
end
if mode == 'ifPresent' then
  if not current then return 0 end
  if pending_since and now_ms() - tonumber(pending_since) <= tonumber(ARGV[5]) then return 1 end
end
if not pending_since and tonumber(current or 0) > generation then return 0 end
if keys_round ~= '' then
  if redis.call('GET', base .. 'kr') ~= keys_round then return 0 end
  redis.call('DEL', base .. 'kr')
end
redis.call('SET', key, generation)
return 1
