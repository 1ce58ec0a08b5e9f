/**
 * Redis key names. Every key of a pool carries the pool name in a {hash tag}, so a Redis Cluster keeps
 * all of them in one slot and one Lua script may touch them atomically.
 */
export function poolBase(prefix: string, pool: string): string {
  return `${prefix}{${pool}}:`;
}

export const poolKeys = (prefix: string, pool: string) => {
  const base = poolBase(prefix, pool);
  return {
    base,
    free: `${base}free`,
    /** The hash caching this item while it is unallocated (ids in buckets of 100, see _lib.lua). */
    itemBucket: (resourceId: string) => `${base}item:${resourceId.slice(0, -2) || '0'}`,
    /** Key layout 1's item cache, one hash a pool; dropped when found (see HoldStore.dropLegacyItemCache). */
    legacyItems: `${base}item`,
    /** The index of the free items whose attribute `key` has this value (a ZSET, see _lib.lua). */
    attribute: (key: string, value: string) => `${base}fz:${key}\0${value}`,
    expiries: `${base}exp`,
    generation: `${base}gen`,
    /** The rebuild round putting the pool's Idempotency-Keys back, until it writes the generation (set_generation). */
    keysRound: `${base}kr`,
    hold: (resourceId: string) => `${base}h:${resourceId}`,
    reservation: (reservationId: string) => `${base}r:${reservationId}`,
    idempotency: (key: string) => `${base}idem:${key}`,
  };
};

/**
 * Version of the key layout below. A new layout renames the marker, so an instance of the new version
 * finds no marker and rebuilds Redis from Postgres as after a wipe (2: item cache in buckets of 100;
 * 3: attribute indexes are value-ordered ZSETs, `fz:`, instead of SETs, `fa:`).
 */
const KEY_LAYOUT = 3;

/**
 * The attribute SETs of key layout 2, in every pool (dropped by HoldStore.dropLegacyAttributeSets): a glob to
 * scan for, and the exact test of a name (the glob also matches other keys holding "}:fa:", as an idempotency
 * key may).
 */
export function legacyAttributeSets(prefix: string): { glob: string; matches: (key: string) => boolean } {
  const exact = new RegExp(`^${prefix.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')}\\{[a-z0-9][a-z0-9_-]*\\}:fa:`);
  return { glob: `${prefix}{*}:fa:*`, matches: (key) => exact.test(key) };
}

/** Present while Redis holds state rebuilt from Postgres; its absence means Redis was wiped. */
export function markerKey(prefix: string): string {
  return `${prefix}meta:rebuilt:${KEY_LAYOUT}`;
}

/**
 * The markers of the key layouts before this one (layout 1's had no number). This version's rebuilds drop them, so
 * that a version before it, started on this Redis again (a rollback), finds none and rebuilds it.
 */
export function legacyMarkerKeys(prefix: string): string[] {
  return [`${prefix}meta:rebuilt`, ...Array.from({ length: KEY_LAYOUT - 2 }, (_, i) => `${prefix}meta:rebuilt:${i + 2}`)];
}

/**
 * Redis' copy of the checkpoint (RebuildService.checkpoint): the number Postgres had when an instance last raised it
 * here. Its hash tag is the marker's name, so that a Redis Cluster keeps both in one slot (scripts read them together).
 */
export function checkpointKey(prefix: string): string {
  return `${prefix}meta:checkpoint{${markerKey(prefix)}}`;
}

/**
 * The keys of the pools named in `pools` (see HoldStore.dropAll): a glob to scan for, and the pool a key found belongs
 * to, or null (another pool's, another deployment's whose prefix starts with this one, another application's).
 */
export function poolKeysOf(prefix: string, pools: readonly string[]): { glob: string; poolOf: (key: string) => string | null } {
  const quoted = prefix.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');
  const poolKey = new RegExp(`^${quoted}\\{([a-z0-9][a-z0-9_-]*)\\}:`);
  const known = new Set(pools);
  return {
    glob: `${prefix}{*`,
    poolOf: (key) => {
      const pool = poolKey.exec(key)?.[1];
      return pool !== undefined && known.has(pool) ? pool : null;
    },
  };
}

/** A key only one round of one rebuild writes (`run` names it), so that only a wipe of Redis removes it. */
export function rebuildRunKey(prefix: string, run: string): string {
  return `${prefix}meta:rebuild-run:${run}`;
}

/** The member an item has in the free index: value, NUL, id (sorted by value for prefix search). */
export function freeMember(value: string, id: string): string {
  return `${value}\0${id}`;
}

/** A hold key's value once its item is allocated: "A:<version>", a tombstone rather than a reservation id. */
export function isAllocationTombstone(holder: string): boolean {
  return holder.startsWith('A:');
}

// Reservation and lease ids: "<pool>.<uuid v4>". The pool part routes the id to its pool's keys;
// the 122 random bits of the UUID are what make it unguessable.
const RESERVATION_ID = /^([a-z0-9][a-z0-9_-]{0,62})\.([0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12})$/;

export function makeReservationId(pool: string, uuid: string): string {
  return `${pool}.${uuid}`;
}

export function poolOfReservationId(id: string): string | null {
  const match = RESERVATION_ID.exec(id);
  return match ? match[1] : null;
}

export const RESERVATION_ID_PATTERN = RESERVATION_ID.source;
