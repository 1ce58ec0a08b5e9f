-- set_generation: writes a pool's Redis generation, never lowering it: an instance that stalled (past its rebuild
-- lease) must not put back a generation older than the one a newer rebuild wrote, or every hold taken since would
-- carry a generation Postgres no longer accepts.
-- ARGV: 1 base, 2 generation, 3 mode: "always" (a rebuild in a new generation), "ifMissing" (a new pool), "ifPresent"
--       (a rebuild in the current generation: a missing key means Redis was wiped since), 4 with "always", the rebuild
--       round that put the pool's Idempotency-Keys back (<base>kr, see RebuildService): gone, Redis was wiped since,
--       and with it the keys; the generation is not written, so that no reserve there makes a second reservation for
--       a key not back yet
-- Returns: 1 if the key now holds the generation, 0 if it was left as it was
local base, generation, mode, keys_round = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4] or ''
local key = base .. 'gen'
local current = redis.call('GET', key)
if (mode == 'ifMissing' and current) or (mode == 'ifPresent' and not current) then return 0 end
if current and tonumber(current) > generation then return 0 end
if keys_round ~= '' then
  if redis.call('GET', base .. 'kr') ~= keys_round then return 0 end
  redis.call('DEL', base .. 'kr')
end
redis.call('SET', key, generation)
return 1
