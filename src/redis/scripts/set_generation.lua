-- set_generation: writes a pool's Redis generation, never lowering it: an instance that stalled (past its rebuild
-- lease) must not put back a generation older than the one a newer rebuild wrote, or every hold taken since would
-- carry a generation Postgres no longer accepts.
-- ARGV: 1 base, 2 generation, 3 mode: "always" (a rebuild in a new generation), "ifMissing" (a new pool), "ifPresent"
--       (a rebuild in the current generation: a missing key means Redis was wiped since)
-- Returns: 1 if the key now holds the generation, 0 if it was left as it was
local base, generation, mode = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local key = base .. 'gen'
local current = redis.call('GET', key)
if (mode == 'ifMissing' and current) or (mode == 'ifPresent' and not current) then return 0 end
if current and tonumber(current) > generation then return 0 end
redis.call('SET', key, generation)
return 1
