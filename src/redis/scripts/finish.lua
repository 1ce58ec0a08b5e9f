-- finish: last step of confirm/complete, after the Postgres commit. Marks the chosen items allocated
-- (an "A:<version>" tombstone hold keeps a rebuild that read Postgres before the commit from re-adding
-- them), returns every other item of the reservation to the free index, and closes the reservation.
-- ARGV: 1 base, 2 rid, 3 selection (ids, comma separated, sorted), 4 outcome JSON, 5 tombstone ms,
--       6 retention ms, 7.. pairs: a chosen item's free-index member, its version after the allocation
--       (so this works even if the reservation is gone)
-- Returns: number of items returned to the free index
local base, rid, selection, outcome = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local tombstone_ms, retention = tonumber(ARGV[5]), tonumber(ARGV[6])
local rkey = base .. 'r:' .. rid
local r = read_reservation(rkey)
local items = r and decode_items(r.i) or {}
local listed = {}
for _, item in ipairs(items) do listed[item.id] = true end
local chosen, free_again, freed, came_free, waited = {}, {}, 0, {}, waited_in(base)
for i = 7, #ARGV, 2 do
  local m, version = ARGV[i], tonumber(ARGV[i + 1])
  local id = id_of(m)
  chosen[id] = true
  local cached = decode_item(item_get(base, id))
  if cached and cached.n >= version then
    -- A cache entry at this version or newer: the item was released since (a late finish, by the sweeper
    -- after the owner had already released it). It is free at that version; our pinned hold must go.
    local n, fresh = free_items(base, rid, { cached }, false, waited)
    freed = freed + n
    append_items(came_free, fresh)
    free_again[id] = true
  else
    local hkey = base .. 'h:' .. id
    local holder = redis.call('GET', hkey)
    -- Never overwrite someone else's live hold, nor a newer allocation's tombstone (this finish is late: the
    -- item was released and allocated again since); Postgres has the truth.
    local allocated_at = is_tombstone(holder) and tonumber(string.sub(holder, 3))
    if not holder or holder == rid or (allocated_at and allocated_at <= version) then
      redis.call('SET', hkey, tombstone(version), 'PX', tombstone_ms)
    end
    item_del(base, id)
    -- An item of the reservation leaves every free index below (unindex); one it does not list, here.
    if not listed[id] then redis.call('ZREM', base .. 'free', m) end
  end
end

if r then
  local rest = {}
  for _, item in ipairs(items) do
    if not chosen[item.id] then
      rest[#rest + 1] = item
    elseif not free_again[item.id] then
      unindex(base, item)
    end
  end
  local fields = { 's', 'confirmed', 'x', outcome, 'sel', selection }
  if r.s ~= 'confirmed' then
    uncount_into(base, r, items, fields)
    local n, fresh = free_items(base, rid, rest, false, waited)
    freed = freed + n
    append_items(came_free, fresh)
  end
  redis.call('HSET', rkey, unpack(fields))
  redis.call('PEXPIRE', rkey, retention)
end
redis.call('ZREM', base .. 'exp', rid)
wake_waiters(base, came_free)
return freed
