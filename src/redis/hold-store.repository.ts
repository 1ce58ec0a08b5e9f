import { Inject, Injectable, Logger, OnApplicationShutdown } from '@nestjs/common';
import { createHash, randomUUID } from 'node:crypto';
import type { Redis } from 'ioredis';
import { AppConfig } from '../config/app-config.js';
import type { ResourceRow } from '../database/resource.repository.js';
import { isRedisOutage } from '../common/dependency-errors.js';
import { DomainError, ErrorCode } from '../common/errors.js';
import { Later } from '../common/later.js';
import { loadScript } from './lua-prelude.js';
import {
  checkpointKey,
  freeMember,
  legacyAttributeSets,
  legacyMarkerKeys,
  markerKey,
  poolBase,
  poolKeys,
  poolKeysOf,
  rebuildRunKey,
} from './keys.js';
import {
  ConnectionWatch,
  REDIS,
  REDIS_TIMEOUT_MESSAGE,
  evictionPolicyOf,
  evictionRefusal,
  redisNowMs,
  warnEachError,
  withTimeout,
} from './redis.client.js';
import { monotonicMs } from '../common/clock.js';

/**
 * An item as Redis caches it: the JSON stored in the item hash, in reservations and in imports. The
 * group key and the attributes are left out when empty (every byte counts a million times).
 */
export interface CachedItem {
  id: string;
  v: string;
  n: number;
  g?: string | null;
  a?: Record<string, string>;
}

/** A Postgres row as Redis caches it; the cache leaves a missing group and empty attributes out. */
export function toCachedItem(row: Pick<ResourceRow, 'id' | 'value' | 'version' | 'groupKey' | 'attributes'>): CachedItem {
  const item: CachedItem = { id: row.id, v: row.value, n: row.version };
  if (row.groupKey !== null) item.g = row.groupKey;
  if (keyCount(row.attributes) > 0) item.a = row.attributes;
  return item;
}

/** `Object.keys(record).length`, without the array: an import counts the keys of every item. */
function keyCount(record: object): number {
  let n = 0;
  for (const key in record) if (Object.hasOwn(record, key)) n++;
  return n;
}

export type StoredState = 'held' | 'confirming' | 'confirmed' | 'released' | 'expired';

export interface StoredReservation {
  id: string;
  state: StoredState;
  owner: string;
  kind: 'r' | 'l';
  createdMs: number;
  expiresMs: number;
  items: CachedItem[];
  outcome: Record<string, unknown> | null;
  /** Redis server time when this was read: every expiry decision uses the Redis clock. */
  nowMs: number;
  /** Commit epoch: 0 until a confirm first pins the reservation. */
  epoch: number;
  /** The Redis generation the holds were taken in. */
  generation: number;
  /** End of the commit window of the latest pin (Redis clock); 0 if never pinned. */
  pinnedUntilMs: number;
}

export interface ReserveRequest {
  reservationId: string;
  owner: string;
  count: number;
  ttlMs: number;
  maxHoldsPerOwner: number;
  kind: 'r' | 'l';
  idempotencyKey?: string;
  bodyHash?: string;
  attributes?: Record<string, string>;
  valuePrefix?: string;
  groupAffinity: boolean;
  /** A reservation the Idempotency-Key may be taken from though it names it: neither Redis nor Postgres has it. */
  forgotten?: string;
  /** The reserve waits for free items (waitMs): it takes its turn in its filter's waiting line (waitingLine). */
  waits?: boolean;
}

export type ReserveResult =
  | { status: 'ok' | 'replay'; reservation: StoredReservation }
  /** `limited`: a filtered reserve stopped looking before it had seen every candidate (reserve.lua, MAX_LOOKUPS). */
  /**
   * `waitersAhead`: a reserve that waits found `count` free but for the items kept for this many reserves that began to
   * wait before it, with its filter (reserve.lua, `line`). `inLine`: for a reserve that waits in a line, how many live
   * waiters are ahead of it (of the first 64); `spare`: how many matching free items (index entries, stale ones
   * included) those waiters leave, too few for this one and maybe enough for smaller ones behind it.
   */
  | { status: 'exhausted'; limited: boolean; waitersAhead?: number; inLine?: number; spare?: number }
  | { status: 'quota'; held: number }
  | { status: 'reused' }
  /**
   * The Idempotency-Key names a reservation Redis no longer has a record of (put back by a rebuild, RebuildService): the
   * answer is its Postgres commit; with none, the reserve is sent again with `forgotten` set to this id.
   */
  | { status: 'landed'; reservationId: string };

/**
 * A pin that took: `retaken`, the selected items whose hold had run out, which the pin took back; `opened`, the pin
 * started the epoch rather than joining one; `pinNumber`, its number among the reservation's pins (all for unpin).
 * A pin sent twice (a Redis timeout) whose first run opened the epoch reports that run's `opened`, `retaken` and
 * `pinNumber` (the second run takes no number of its own).
 */
export interface Pinned {
  status: 'pinned';
  reservation: StoredReservation;
  retaken: string[];
  opened: boolean;
  pinNumber: number;
  /** The Idempotency-Key the reservation was made with, if any: its commit records it (see RebuildService). */
  idempotency?: IdempotencyRecord;
}

/** An Idempotency-Key and the hash of the body it was first sent with. */
export interface IdempotencyRecord {
  key: string;
  bodyHash: string;
}

/** An Idempotency-Key, and when the reservation it was made with was made (Redis clock, ms): it lasts IDEMPOTENCY_TTL_MS from then. */
export interface KeyedReservation extends IdempotencyRecord {
  createdMs: number;
}

/** A record's "<key>\n<body hash>" (reserve.lua), or undefined for "" (made without a key). */
function parseIdempotency(field: string | undefined): IdempotencyRecord | undefined {
  if (!field) return undefined;
  const cut = field.indexOf('\n');
  return { key: field.slice(0, cut), bodyHash: field.slice(cut + 1) };
}

export type PinResult =
  | { status: 'confirmed'; reservation: StoredReservation }
  | Pinned
  | { status: 'missing' | 'closed' }
  | { status: 'notin' | 'lost'; resourceId: string };

export type ReleaseResult =
  | { status: 'released' | 'confirmed'; reservation: StoredReservation }
  | { status: 'undecided'; epoch: number }
  | { status: 'busy' | 'missing' };

export type ExtendResult =
  { status: 'extended'; reservation: StoredReservation } | { status: 'expired' | 'confirming' | 'closed' | 'missing' };

export interface AllocatedItem {
  resourceId: string;
  value: string;
  /** The item's version after the allocation. */
  version: number;
}

export interface SweepResult {
  expiredReservations: number;
  freedItems: number;
  /** The batch was full or ended at its work budget: more may be due now. */
  more: boolean;
  stalled: string[];
}

const SCRIPT_DIR = new URL('./scripts/', import.meta.url);
const SCRIPTS = [
  'reserve',
  'read',
  'pin',
  'unpin',
  'finish',
  'release',
  'extend',
  'sweep',
  'abort',
  'add_free',
  'set_generation',
  'leave',
] as const;
type ScriptName = (typeof SCRIPTS)[number];
type ScriptCall = (key: string, ...args: (string | number)[]) => Promise<unknown>;

/** Tombstone of an allocated item: long enough that a rebuild page read before the commit cannot re-add it. */
export const TOMBSTONE_MS = 60_000;
/**
 * An open (held, confirming) reservation's record outlives its hold by at least this long, whatever
 * RESERVATION_RETENTION_MS says (that is how long a closed one stays readable). The sweeper reads the record
 * to close it: to give its items back and lower its owner's count. Gone before a sweep reached it (no
 * instance sweeping for longer than a short retention: a restart), its items would wait for the next rebuild
 * and its owner would keep counting them against maxHoldsPerOwner.
 */
export const OPEN_RECORD_MARGIN_MS = 86_400_000;
/** A rebuild round's key outlives any round (a lingering one, of a round that died, expires). */
const REBUILD_RUN_KEY_MS = 24 * 3600_000;
/**
 * A new pool's pending generation key (set_generation.lua) is finalized by its creator within a request; one older than
 * this was left by a creator that died or stalled, and a rebuild finalizes it.
 */
export const PENDING_GENERATION_MS = 30_000;
/** Reserves and pins waiting to be undone at most (undoLater); past that, one is left to expire with its hold. */
const MAX_PENDING_UNDOS = 10_000;
/** A request that got no answer from Redis, to undo: a reserve, or a confirm's pin (by its attempt's token). */
type Undo = { pool: string; reservationId: string; idempotencyKey?: string } | { pool: string; reservationId: string; token: string };
/** What a call acts on: 'r' a reservation, 'l' a task lease, '' either (a record of the other kind is missing to it). */
export type RecordKind = 'r' | 'l' | '';

/** The rebuilt-marker and Redis' checkpoint, as read together (null: the key is missing). */
export interface RedisCheckpoint {
  marker: string | null;
  n: number | null;
}
/** In the marker's value while a rebuild round runs: `<generation> rebuilding:<run>`. */
export const REBUILDING = ' rebuilding:';
/** The marker set to ARGV[2] only over ARGV[1] (Redis 7.0 has no SET ... IFEQ). */
const MARK_REBUILT = `if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('SET', KEYS[1], ARGV[2]) return 1 end return 0`;
/**
 * Redis' checkpoint (KEYS[2]) set to ARGV[3] only while the marker (KEYS[1]) is ARGV[1] and the checkpoint ARGV[2] ("":
 * none), as the caller read them: not into a Redis wiped and rebuilt since, nor over a number another instance wrote.
 */
const SET_CHECKPOINT = `if redis.call('GET', KEYS[1]) ~= ARGV[1] or (redis.call('GET', KEYS[2]) or '') ~= ARGV[2] then return 0 end
redis.call('SET', KEYS[2], ARGV[3]) return 1`;
/** After a check of a new connection to Redis that could not tell (see HoldStore.checkOnConnect), requests go on this long. */
/** No command answered for this long (or five REDIS_TIMEOUT_MS, if longer) while commands time out: the connection is made again. */
export const DEAD_CONNECTION_MS = 10_000;
const CONNECT_RECHECK_MS = 1000;
const CONNECT_RECHECK_MAX_MS = 16_000;
/** A pool's generation (KEYS[1]) dropped only if it is ARGV[1] or older (see HoldStore.dropAll). */
const DROP_GENERATION = `local gen = redis.call('GET', KEYS[1])
if gen and (tonumber(gen) or 0) <= tonumber(ARGV[1]) then return redis.call('DEL', KEYS[1]) end return 0`;
/**
 * A pool's keys (KEYS[3..]) unlinked only while it has no generation (KEYS[1]) and no rebuild is putting its
 * Idempotency-Keys back (KEYS[2]); -1 if not.
 */
const DROP_POOL_KEYS = `if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
return redis.call('UNLINK', unpack(KEYS, 3))`;
/**
 * The marker (KEYS[1]) dropped while it is ARGV[1], and the checkpoint (KEYS[2]) while it is still behind Postgres'
 * ARGV[2] (two or more below it: one started again since is not), in one step.
 */
const DROP_MARKER = `local dropped = 0
if redis.call('GET', KEYS[1]) == ARGV[1] then dropped = dropped + redis.call('DEL', KEYS[1]) end
local n = redis.call('GET', KEYS[2])
if n and tonumber(n) < tonumber(ARGV[2]) - 1 then dropped = dropped + redis.call('DEL', KEYS[2]) end
return dropped`;
/** addFree adds nothing from a Postgres read older than this (Redis' clock), well inside a tombstone's life. */
export const READ_MAX_AGE_MS = TOMBSTONE_MS / 2;
/**
 * One addFree script takes at most this many items, and ends early once its items take ADD_FREE_WRITES writes
 * (each: its cache entry, the free index, one per attribute, one for a group): Redis serves nothing else while a
 * script runs, and 500 items of 33 attributes each held it for 73-130 ms (a review's measurement). Plain items
 * (2-3 writes) still go 500 at a time.
 */
const ADD_FREE_ITEMS = 500;
export const ADD_FREE_WRITES = 2_000;

/** What indexing the item writes in Redis (see ADD_FREE_WRITES). */
export function indexWrites(item: CachedItem): number {
  return 2 + (item.a ? keyCount(item.a) : 0) + (item.g === undefined || item.g === null ? 0 : 1);
}

/**
 * A waiter keeps its place in the waiting line this long without a try (reserve.lua, `line`): a waiter tries at least
 * every 375 ms (ReservationsService), and one whose instance died or stalled holds up the items it waits for at most
 * this long; back after that, it joins at the end.
 */
export const WAIT_PLACE_MS = 1_000;

/**
 * A waiter whose filter has several conditions (no line) pauses up to this long between tries while wake-ups are live
 * (ReservationsService), and marks the pool as waited in (`<base>ww`, which the freeing scripts publish for) for
 * WAIT_LINELESS_MARK_MS: 1.5 times that, as a pause is drawn up to it, and some to spare.
 */
export const WAIT_LINELESS_PAUSE_MS = 2_000;
const WAIT_LINELESS_MARK_MS = WAIT_LINELESS_PAUSE_MS * 1.5 + 500;

/**
 * The waiting line a reserve that waits takes its turn in (reserve.lua, `line`), or '' for none: one line for no
 * filter, one for each value prefix alone and each attribute pair alone, named by a hash of the filter. Task pulls
 * (kind 'l') never wait; filters with several conditions have no line (Redis cannot count their free items without a
 * walk).
 */
export function waitingLine(req: Pick<ReserveRequest, 'kind' | 'attributes' | 'valuePrefix'>): string {
  if (req.kind !== 'r') return '';
  const attributes = req.attributes ? Object.entries(req.attributes) : [];
  const prefix = req.valuePrefix ?? '';
  if (attributes.length + (prefix === '' ? 0 : 1) > 1) return '';
  if (attributes.length === 0 && prefix === '') return '-';
  const filter = attributes.length === 1 ? ['a', attributes[0][0], attributes[0][1]] : ['p', prefix];
  return createHash('sha256').update(JSON.stringify(filter)).digest('base64url').slice(0, 16);
}

function parseReservation(reply: string[]): StoredReservation {
  const [, id, state, owner, kind, created, expires, items, outcome, now, epoch, generation, pinnedUntil] = reply;
  return {
    id,
    state: state as StoredState,
    owner,
    kind: kind as 'r' | 'l',
    createdMs: Number(created),
    expiresMs: Number(expires),
    items: JSON.parse(items) as CachedItem[],
    outcome: outcome ? (JSON.parse(outcome) as Record<string, unknown>) : null,
    nowMs: Number(now),
    epoch: Number(epoch ?? 0),
    generation: Number(generation ?? 0),
    pinnedUntilMs: Number(pinnedUntil ?? 0),
  };
}

/**
 * Everything respool keeps in Redis, behind one repository: the free index, holds, reservations and
 * their expiry. Each hot-path operation is one Lua script (EVALSHA via ioredis defineCommand).
 */
@Injectable()
export class HoldStore implements OnApplicationShutdown {
  private readonly logger = new Logger(HoldStore.name);
  private readonly prefix: string;
  private readonly retentionMs: number;
  /** How long an open reservation's record outlives its hold (see OPEN_RECORD_MARGIN_MS). */
  private readonly openRecordMs: number;
  /** Waiters' leaves sent and not answered yet (leaveLine), and waits under way (whileOpen): Redis closes after them. */
  private readonly unfinished = new Set<Promise<unknown>>();

  constructor(
    @Inject(REDIS) private readonly redis: Redis,
    private readonly config: AppConfig,
  ) {
    this.prefix = config.REDIS_KEY_PREFIX;
    // Connection errors surface as 503s on the requests that meet them; log each distinct one once.
    warnEachError(redis, (message) => this.logger.warn(`redis: ${message}`));
    this.retentionMs = config.RESERVATION_RETENTION_MS;
    this.openRecordMs = Math.max(config.RESERVATION_RETENTION_MS, OPEN_RECORD_MARGIN_MS);
    for (const name of SCRIPTS) {
      if (!(name in redis)) redis.defineCommand(`rp_${name}`, { numberOfKeys: 1, lua: loadScript(SCRIPT_DIR, name) });
    }
  }

  private async run<T>(name: ScriptName, pool: string, ...args: (string | number)[]): Promise<T> {
    // A timed-out command may or may not have run. Every script but reserve has the same effect when run
    // twice, so those get one more try.
    return this.script<T>(name, pool, args, name !== 'reserve');
  }

  private async script<T>(name: ScriptName, pool: string, args: (string | number)[], retryOnTimeout: boolean): Promise<T> {
    const base = poolBase(this.prefix, pool);
    const call = (this.redis as unknown as Record<string, ScriptCall>)[`rp_${name}`];
    // KEYS[1] (the free index) names the pool's slot (for Redis Cluster routing); the scripts build their keys from
    // the base.
    const once = () =>
      withTimeout(call.call(this.redis, `${base}free`, base, ...args) as Promise<T>, this.config.REDIS_TIMEOUT_MS, this.watch);
    try {
      return await once().catch((err: unknown) => {
        if (retryOnTimeout && err instanceof Error && err.message === REDIS_TIMEOUT_MESSAGE) return once();
        throw err;
      });
    } catch (err) {
      throw isRedisOutage(err) ? DomainError.unavailable('redis', err) : err;
    }
  }

  /**
   * Since when no command has been answered, while some timed out (the send of the first of them); null once one is.
   * See `watch`.
   */
  private silentSince: number | null = null;

  /**
   * The watch of the connection (withTimeout tells it of every command): one on which no command is answered for
   * DEAD_CONNECTION_MS, while commands time out, is made again. One a failover or a NAT left black-holed (the peer gone
   * without a reset) answered every command 503 until the kernel gave the connection up, a quarter of an hour later.
   * (Redis busy with one long command for that long loses its connection too, which changes nothing: what was in
   * flight has been answered a timeout.)
   */
  private readonly watch: ConnectionWatch = {
    answered: () => {
      this.silentSince = null;
    },
    timedOut: () => {
      const now = monotonicMs();
      this.silentSince ??= now - this.config.REDIS_TIMEOUT_MS;
      if (now - this.silentSince >= Math.max(DEAD_CONNECTION_MS, 5 * this.config.REDIS_TIMEOUT_MS) && this.redis.status === 'ready') {
        this.logger.warn(`redis: no answer for ${Math.round(now - this.silentSince)} ms; connecting again`);
        this.silentSince = null;
        this.redis.disconnect(true);
      }
    },
  };

  private async command<T>(fn: () => Promise<T>): Promise<T> {
    try {
      return await withTimeout(fn(), this.config.REDIS_TIMEOUT_MS, this.watch);
    } catch (err) {
      throw isRedisOutage(err) ? DomainError.unavailable('redis', err) : err;
    }
  }

  /**
   * Each time the connection to Redis is made (at start, after a restart or a failover), Redis may have gone back in
   * time: until `check` has resolved true once since, every reserve, read and release first waits for it, and every pin
   * and extend waits for it after its script (checkedAfter) (one check at a time, shared), and a rejection answers it
   * (a 503), the next one running it again. Resolved false (it
   * could not tell: Postgres did not answer), they go on unchecked for a second, and the next one after that runs it again (after two seconds the
   * next time in a row, then four, up to 16).
   */
  checkOnConnect(check: () => Promise<boolean>): void {
    this.connectCheck = check;
    // At 'close' too: ioredis is ready, and sends, a tick before it emits 'ready'.
    this.redis.on('close', () => this.connects++);
    this.redis.on('ready', () => {
      this.connects++;
      // A new connection is checked at once, even while checks that could not tell back off.
      this.uncheckedUntil = 0;
    });
  }

  private connectCheck: (() => Promise<boolean>) | null = null;
  /** Connections to Redis opened or closed so far (the one open when checkOnConnect was called counts as the first). */
  private connects = 1;
  /** The count of connections made when the last check that resolved true began. */
  private checkedConnects = 0;
  /** Until then, after a check that could not tell, requests go on unchecked. */
  private uncheckedUntil = 0;
  /** Checks in a row that could not tell. */
  private uncheckedInARow = 0;
  private connectChecking: Promise<void> | null = null;

  /** The check a request waits for, until one resolves true on the current connection (see checkOnConnect). */
  private connectChecked(): Promise<void> | null {
    if (this.connectCheck === null || this.checkedConnects === this.connects || monotonicMs() < this.uncheckedUntil) return null;
    const connects = this.connects;
    this.connectChecking ??= this.connectCheck()
      .then((checked) => {
        if (checked) {
          this.checkedConnects = Math.max(this.checkedConnects, connects);
          this.uncheckedInARow = 0;
        } else if (this.connects === connects) {
          // (Not if the connection changed meanwhile: the new one waits for a check of its own.) Longer each time in a
          // row: a Postgres that hangs does not hold every reserve up once a second.
          this.uncheckedUntil = monotonicMs() + Math.min(CONNECT_RECHECK_MS * 2 ** this.uncheckedInARow, CONNECT_RECHECK_MAX_MS);
          this.uncheckedInARow++;
        }
      })
      .catch((err: unknown) => {
        // (Postgres answered: Redis is behind, or Redis failed.)
        this.uncheckedInARow = 0;
        throw err;
      })
      .finally(() => {
        this.connectChecking = null;
      });
    return this.connectChecking;
  }

  /** Waits for the check `unchecked` of a new connection, and again if the connection changed during it (see checkOnConnect). */
  private async whenChecked(unchecked: Promise<void>): Promise<void> {
    for (let checked: Promise<void> | null = unchecked; checked !== null; checked = this.connectChecked()) await checked;
  }

  /**
   * For a call with a deadline (a pin or an extend received just before its hold's end): the script runs at once, the
   * check of a new connection (started before it, if due) is waited for after it, and a rejection of the check answers
   * the call (503) with `undo` run first. The check may take a second (Postgres slow): before it, the hold could end.
   */
  private async checkedAfter<T>(script: () => Promise<T>, undo: (result: T) => Promise<unknown>): Promise<T> {
    // (Its rejection kept, not left unhandled while the script runs.)
    const early = this.connectChecked()?.then(
      () => null,
      (err: unknown) => ({ err }),
    );
    const result = await script();
    try {
      const failed = await early;
      if (failed) throw failed.err;
      // Again if the connection changed meanwhile (the script may have run on the new one).
      const unchecked = this.connectChecked();
      if (unchecked) await this.whenChecked(unchecked);
    } catch (err) {
      await undo(result).catch(() => undefined);
      throw err;
    }
    return result;
  }

  async reserve(pool: string, req: ReserveRequest): Promise<ReserveResult> {
    const unchecked = this.connectChecked();
    if (unchecked) await this.whenChecked(unchecked);
    const line = req.waits ? waitingLine(req) : '';
    let reply: string[];
    try {
      reply = await this.run<string[]>(
        'reserve',
        pool,
        req.reservationId,
        req.owner,
        req.count,
        req.ttlMs,
        req.maxHoldsPerOwner,
        req.kind,
        this.openRecordMs,
        req.idempotencyKey ?? '',
        req.bodyHash ?? '',
        this.config.IDEMPOTENCY_TTL_MS,
        req.attributes && Object.keys(req.attributes).length > 0 ? JSON.stringify(req.attributes) : '',
        req.valuePrefix ?? '',
        req.groupAffinity ? '1' : '0',
        this.config.HOLD_GRACE_MS,
        line,
        // (Only the pool's waited-in mark lasts as long as `place` for a waiter with no line: it has no place.)
        req.waits && line === '' ? WAIT_LINELESS_MARK_MS : WAIT_PLACE_MS,
        req.waits && this.config.WAIT_WAKE_UPS === 'true' ? '1' : '',
        req.forgotten ?? '',
      );
    } catch (err) {
      // A reserve that got no answer (timed out, or its connection lost) may have run in Redis, or may still,
      // and the caller is answered 503 (nothing changed): it is undone. After a timeout, on the same
      // connection (Redis runs one connection's commands in order, and none is re-sent after a reconnect);
      // when that fails too (the connection lost), the sweeper's upkeep sends the undo again until Redis takes
      // it. An undo that runs first leaves a record that keeps the reserve, should it still arrive, from
      // holding anything. Its Idempotency-Key, if it names it, is forgotten, so that a retry with the key makes
      // a new reservation rather than replay a released one.
      if (err instanceof DomainError && err.code === ErrorCode.DEPENDENCY_UNAVAILABLE && !neverSent(err)) {
        await this.giveBack(pool, req);
      }
      throw err;
    }
    switch (reply[0]) {
      case 'ok':
      case 'replay':
        return { status: reply[0], reservation: parseReservation(reply) };
      case 'quota':
        return { status: 'quota', held: Number(reply[1]) };
      case 'landed':
        return { status: 'landed', reservationId: reply[1] };
      case 'exhausted':
        switch (reply[1]) {
          case 'waiters':
            return {
              status: 'exhausted',
              limited: false,
              waitersAhead: Number(reply[2]),
              inLine: Number(reply[3]),
              spare: Number(reply[4]),
            };
          case 'line':
            // No spare: the pick found too few (stale index entries), which it dropped.
            if (reply[3] === undefined) return { status: 'exhausted', limited: false, inLine: Number(reply[2]) };
            return { status: 'exhausted', limited: false, inLine: Number(reply[2]), spare: Number(reply[3]) };
          default:
            return { status: 'exhausted', limited: reply[1] === 'limited' };
        }
      default:
        return { status: 'reused' };
    }
  }

  async read(pool: string, reservationId: string): Promise<StoredReservation | null> {
    const unchecked = this.connectChecked();
    if (unchecked) await this.whenChecked(unchecked);
    return this.peek(pool, reservationId);
  }

  /**
   * A read that does not wait for the check of a new connection (see checkOnConnect): only for a caller that acts
   * next through a call that does (pin, extend, release), and answers nothing from this read that Redis going back in
   * time could have made wrong (a reservation's owner and kind never change). A heartbeat reads its lease first: it
   * must not wait here, past the lease's end.
   */
  async peek(pool: string, reservationId: string): Promise<StoredReservation | null> {
    const reply = await this.run<string[]>('read', pool, reservationId);
    return reply[0] === 'ok' ? parseReservation(reply) : null;
  }

  /**
   * `endedEpoch`: an epoch Postgres has ended; the pin starts a new one rather than join it. `kind`: as for release.
   */
  async pin(
    pool: string,
    reservationId: string,
    selection: string[],
    windowMs: number,
    endedEpoch?: number,
    kind: RecordKind = '',
  ): Promise<PinResult> {
    // Pinned at once, checked before the commit: should Redis be found behind, what the pin did is undone (the attempt
    // surely never reached Postgres), and the confirm answered 503.
    return this.checkedAfter(
      () => this.pinNow(pool, reservationId, selection, windowMs, endedEpoch, kind),
      (pinned) => (pinned.status === 'pinned' ? this.unpin(pool, pinned, true) : Promise.resolve()),
    );
  }

  private async pinNow(
    pool: string,
    reservationId: string,
    selection: string[],
    windowMs: number,
    endedEpoch: number | undefined,
    kind: RecordKind,
  ): Promise<PinResult> {
    // The attempt's token: a second send after a timeout carries the same, and learns whether its first run opened
    // the epoch (pin.lua).
    const token = randomUUID();
    let reply: string[];
    try {
      reply = await this.run<string[]>(
        'pin',
        pool,
        reservationId,
        windowMs,
        selection.join(','),
        this.config.HOLD_GRACE_MS,
        endedEpoch ?? '',
        this.openRecordMs,
        token,
        kind,
      );
    } catch (err) {
      // A pin that got no answer may have run, or may still, and the confirm is answered 503 (nothing was changed):
      // it is undone (unpin.lua, by its token), as a reserve that got no answer is (see reserve), so that the
      // reservation is not left confirming, refusing its extend and release, until its commit window ends.
      if (err instanceof DomainError && err.code === ErrorCode.DEPENDENCY_UNAVAILABLE && !neverSent(err)) {
        await this.undoPin(pool, reservationId, token).catch(() =>
          this.later(`p:${reservationId}:${token}`, { pool, reservationId, token }),
        );
      }
      throw err;
    }
    switch (reply[0]) {
      case 'pinned':
        return {
          status: 'pinned',
          reservation: parseReservation(reply),
          retaken: reply[13] ? reply[13].split(',') : [],
          opened: reply[14] === '1',
          pinNumber: Number(reply[15]),
          idempotency: parseIdempotency(reply[16]),
        };
      case 'confirmed':
        return { status: 'confirmed', reservation: parseReservation(reply) };
      case 'notin':
      case 'lost':
        return { status: reply[0], resourceId: reply[1] };
      default:
        return { status: reply[0] as 'missing' | 'closed' };
    }
  }

  /**
   * After the Postgres commit: marks the allocated items (at their new versions) and frees the rest of the
   * reservation. `outcomeJson`: the commit's answer as JSON text, kept for the confirm's retries.
   */
  async finish(pool: string, reservationId: string, allocated: AllocatedItem[], outcomeJson: string): Promise<number> {
    const sorted = [...allocated].sort((a, b) => compareIds(a.resourceId, b.resourceId));
    return this.run<number>(
      'finish',
      pool,
      reservationId,
      sorted.map((a) => a.resourceId).join(','),
      outcomeJson,
      TOMBSTONE_MS,
      this.retentionMs,
      ...sorted.flatMap((a) => [freeMember(a.value, a.resourceId), a.version]),
    );
  }

  /**
   * A commit attempt failed before Postgres decided it: held again until its expiry, unless another pin came
   * since. `pinned`: what the failed pin returned. False if left to the sweeper. `cannotLand`: the attempt surely
   * never reached Postgres, or Postgres has ended its epoch: Redis is then put back as it was before the pin, as
   * far as it can be (unpin.lua). `ended`: Postgres has ended every epoch of it up to this one (implies `cannotLand`):
   * the holds then end with the hold, as if no commit had started.
   */
  async unpin(pool: string, pinned: Omit<Pinned, 'status'>, cannotLand = false, ended = false): Promise<boolean> {
    const { reservation: r, pinNumber, retaken, opened } = pinned;
    const undo = cannotLand || ended ? [retaken.join(','), opened ? '1' : '0', ended ? '1' : '0'] : ['', '0', '0'];
    return (await this.run<number>('unpin', pool, r.id, r.epoch, pinNumber, this.config.HOLD_GRACE_MS, ...undo)) === 1;
  }

  /**
   * `abortedEpoch`: the reservation's commit epoch, which Postgres has recorded as given up. `kind`: what the caller acts
   * on (a reservation, a lease; '': either): a record of the other kind is 'missing' to it.
   */
  async release(pool: string, reservationId: string, abortedEpoch?: number, kind: RecordKind = ''): Promise<ReleaseResult> {
    const unchecked = this.connectChecked();
    if (unchecked) await this.whenChecked(unchecked);
    const reply = await this.run<string[]>('release', pool, reservationId, this.retentionMs, abortedEpoch ?? '', '', '', kind);
    if (reply[0] === 'released' || reply[0] === 'confirmed') return { status: reply[0], reservation: parseReservation(reply) };
    if (reply[0] === 'undecided') return { status: 'undecided', epoch: Number(reply[1]) };
    return { status: reply[0] as 'busy' | 'missing' };
  }

  /**
   * Undoes a reserve request that got no answer: the reservation it made or was answered with (a replay of its
   * Idempotency-Key) is released, and the key forgotten, once no other request that may have been answered with
   * it is left (release.lua). Before the reserve has run, it leaves a released record under the request's id,
   * which the reserve then refuses. Idempotent; sent once (a retry is the upkeep's, see undoLater).
   */
  async undoReserve(pool: string, reservationId: string, idempotencyKey: string | undefined): Promise<void> {
    await this.script<string[]>('release', pool, [reservationId, this.retentionMs, '', '1', idempotencyKey ?? ''], false);
  }

  /**
   * Undoes the pin of a confirm attempt that got no answer, by its token (unpin.lua): if it opened its epoch and no pin
   * came after it, the reservation is held again as before it (true). Idempotent; sent once (a retry is the upkeep's).
   */
  async undoPin(pool: string, reservationId: string, token: string): Promise<boolean> {
    return (await this.script<number>('unpin', pool, [reservationId, '', '', this.config.HOLD_GRACE_MS, '', '', '0', token], false)) === 1;
  }

  /** Reserves and pins that got no answer and could not be undone yet (Redis unreachable), by request. */
  private readonly undos = new Later<Undo>(MAX_PENDING_UNDOS);

  private later(key: string, undo: Undo): void {
    if (!this.undos.add(key, undo)) {
      this.logger.warn(`more than ${MAX_PENDING_UNDOS} requests wait to be undone; ${undo.reservationId} is left to expire`);
    }
  }

  /**
   * Takes a reserve that waited (`waits`) out of its waiting line (reserve.lua, `line`), when it gives up without the
   * items. Never fails: a place not taken out is passed over WAIT_PLACE_MS after the waiter's last try.
   */
  async leaveLine(pool: string, req: ReserveRequest): Promise<void> {
    const line = waitingLine(req);
    if (!req.waits || line === '') return;
    const leave = this.run('leave', pool, line, `${req.count} ${req.reservationId}`)
      .then(() => undefined)
      .catch(() => undefined)
      .finally(() => this.unfinished.delete(leave));
    this.unfinished.add(leave);
    await leave;
  }

  /** Undoes a reserve now (undoReserve), or, if Redis refuses, later (undoLater). Never fails. */
  async giveBack(pool: string, req: ReserveRequest): Promise<void> {
    await this.undoReserve(pool, req.reservationId, req.idempotencyKey).catch(() => this.undoLater(pool, req));
  }

  private undoLater(pool: string, req: ReserveRequest): void {
    this.later(`r:${req.reservationId}`, { pool, reservationId: req.reservationId, idempotencyKey: req.idempotencyKey });
  }

  /** Sends the undos that could not be sent (undoLater) again; run by the sweeper's upkeep. Returns how many went. */
  retryUndos(): Promise<number> {
    return this.undos.retry((undo) =>
      'token' in undo
        ? this.undoPin(undo.pool, undo.reservationId, undo.token)
        : this.undoReserve(undo.pool, undo.reservationId, undo.idempotencyKey),
    );
  }

  /** `kind`: as for release. */
  async extend(pool: string, reservationId: string, ttlMs: number, kind: RecordKind = ''): Promise<ExtendResult> {
    // Extended at once, then checked: a Redis found behind is dropped, this extension with it.
    return this.checkedAfter(
      async (): Promise<ExtendResult> => {
        const reply = await this.run<string[]>('extend', pool, reservationId, ttlMs, this.openRecordMs, this.config.HOLD_GRACE_MS, kind);
        if (reply[0] === 'extended') return { status: 'extended', reservation: parseReservation(reply) };
        return { status: reply[0] as 'expired' | 'confirming' | 'closed' | 'missing' };
      },
      () => Promise.resolve(),
    );
  }

  async sweep(pool: string, batch: number, recheckMs: number, workBudget: number): Promise<SweepResult> {
    const reply = await this.run<(number | string)[]>(
      'sweep',
      pool,
      batch,
      this.retentionMs,
      recheckMs,
      workBudget,
      this.config.HOLD_GRACE_MS,
    );
    return {
      expiredReservations: Number(reply[0]),
      freedItems: Number(reply[1]),
      more: Number(reply[2]) === 1,
      stalled: reply.slice(3).map(String),
    };
  }

  /**
   * Settles a commit epoch Postgres recorded as aborted: held again while the hold is due, else expired
   * with its items freed. `allocated` are items Postgres shows allocated, `fresh` those whose version moved on,
   * both as Postgres showed them in a read made after Redis' clock said `readAt`; 'tooOld' (nothing changed)
   * once that read is older than READ_MAX_AGE_MS, as in addFree.
   */
  async abort(
    pool: string,
    reservationId: string,
    epoch: number,
    readAt: number,
    allocated: { id: string; version: number }[],
    fresh: CachedItem[],
  ): Promise<'held' | 'expired' | 'stale' | 'tooOld'> {
    const reply = await this.run<number>(
      'abort',
      pool,
      reservationId,
      epoch,
      this.retentionMs,
      TOMBSTONE_MS,
      allocated.map((a) => `${a.id}:${a.version}`).join(','),
      this.config.HOLD_GRACE_MS,
      readAt,
      READ_MAX_AGE_MS,
      ...fresh.map((i) => JSON.stringify(i)),
    );
    return reply === -3 ? 'tooOld' : reply === -2 ? 'held' : reply === -1 ? 'stale' : 'expired';
  }

  /**
   * Adds items that are free in Postgres to the free index; returns how many were not there yet, or null if
   * the read was too old by the time a chunk reached Redis (READ_MAX_AGE_MS): the caller stalled, and the rest
   * was not added. `generation` is the Redis generation current when Postgres was read, `readAt` Redis' clock
   * (clock()) taken before that read. When the pool's generation is newer (Redis was wiped and rebuilt since),
   * nothing more is added: the read may hold items allocated since, whose tombstones the wipe took. `skip`: the
   * items were free before `generation` was read, so the rebuild that raised it read them free and added them.
   * `readAgain` (null, like a read too old): they may have become free only after it (the caller read the
   * generation before its own write freed them), and that rebuild may have read Postgres before the write.
   */
  async addFree(
    pool: string,
    generation: number,
    readAt: number,
    items: CachedItem[],
    superseded: 'skip' | 'readAgain' = 'skip',
  ): Promise<number | null> {
    // One chunk at a time: each is one script, and Redis serves nothing else while it runs. Sent together,
    // the chunks of an import or a rebuild page would run back to back and hold up every other command.
    let added = 0;
    for (let i = 0; i < items.length;) {
      const chunk: string[] = [];
      for (let writes = 0; i < items.length && chunk.length < ADD_FREE_ITEMS; i++) {
        writes += indexWrites(items[i]);
        if (chunk.length > 0 && writes > ADD_FREE_WRITES) break;
        chunk.push(JSON.stringify(items[i]));
      }
      const reply = await this.run<number>('add_free', pool, generation, readAt, READ_MAX_AGE_MS, ...chunk);
      if (reply === -2 && superseded === 'skip') return added;
      if (reply < 0) return null;
      added += reply;
    }
    return added;
  }

  /**
   * Puts back the Idempotency-Keys of reservations Redis no longer has, each naming its reservation (the rebuild
   * after a wipe, from their Postgres commits), until IDEMPOTENCY_TTL_MS after the reservation was made, as reserve.lua
   * set them. A key Redis has already stays as it is. Returns how many were put back.
   */
  async restoreIdempotencyKeys(pool: string, keyed: readonly (KeyedReservation & { reservationId: string })[]): Promise<number> {
    const keys = poolKeys(this.prefix, pool);
    const now = await this.clock();
    const batch = this.redis.pipeline();
    let sent = 0;
    for (const k of keyed) {
      const left = k.createdMs + this.config.IDEMPOTENCY_TTL_MS - now;
      if (left <= 0) continue;
      batch.set(keys.idempotency(k.key), `${k.reservationId}\n${k.bodyHash}`, 'PX', left, 'NX');
      sent++;
    }
    if (sent === 0) return 0;
    const replies = await this.command(() => batch.exec());
    for (const [err] of replies ?? []) if (err) throw err;
    return (replies ?? []).filter(([, reply]) => reply === 'OK').length;
  }

  /** Redis' clock in ms, to stamp a Postgres read with for addFree; like ping(), it fails if Redis is down. */
  async clock(): Promise<number> {
    return this.command(() => redisNowMs(this.redis));
  }

  /**
   * Writes the pool's Redis generation: `always` (a rebuild in a new generation), `ifPresent` (a rebuild in the current
   * generation: a missing key means Redis was wiped since, and the old generation must not be written into the new
   * Redis; a pending key is left to its creator until PENDING_GENERATION_MS have passed), `pending` (a pool being
   * created: no reserve or import there yet) and `finalize` (its creator, over its pending key only: see
   * set_generation.lua). Never over a newer generation (one a newer rebuild wrote while this instance stalled).
   * `keysRound`, with `always`: the round that put the pool's Idempotency-Keys back (beginKeyRestore); if Redis has
   * lost its mark since (wiped), nothing is written. Returns whether the key now holds `generation` (for `pending`:
   * whether it is pending).
   */
  async setGeneration(
    pool: string,
    generation: number,
    mode: 'always' | 'ifPresent' | 'pending' | 'finalize',
    keysRound = '',
  ): Promise<boolean> {
    return (await this.run<number>('set_generation', pool, generation, mode, keysRound, PENDING_GENERATION_MS)) === 1;
  }

  /**
   * Finalizes the pool's generation key if it is pending and older than PENDING_GENERATION_MS (its creator died or
   * stalled): `finalized`; `young` if it is pending and younger; `final` if it holds a generation; `missing`.
   */
  async finalizeStale(pool: string, generation: number): Promise<'finalized' | 'young' | 'final' | 'missing'> {
    const reply = await this.run<number>('set_generation', pool, generation, 'finalizeStale', '', PENDING_GENERATION_MS);
    return reply === 1 ? 'finalized' : reply === -1 ? 'young' : reply === 2 ? 'missing' : 'final';
  }

  /**
   * Marks the pool's Idempotency-Keys as being put back by this rebuild round, before the first one is: a wipe of
   * Redis before setGeneration takes the mark with the keys, and the generation is then not written. The mark has no
   * expiry, which a long restore could outlast; setGeneration drops it, and the next round's overwrites one a round
   * that died left behind.
   */
  async beginKeyRestore(pool: string, round: string): Promise<void> {
    await this.command(() => this.redis.set(poolKeys(this.prefix, pool).keysRound, round));
  }

  /** Drops the item cache of key layout 1 (one hash a pool), if an older version left it behind. */
  async dropLegacyItemCache(pool: string): Promise<void> {
    await this.command(() => this.redis.unlink(poolKeys(this.prefix, pool).legacyItems));
  }

  /**
   * Drops the attribute SETs of key layout 2 in every pool (key layout 3 indexes attributes in ZSETs under
   * other names). Walks the whole key space, so the rebuild calls it only after a wipe or an upgrade, and
   * `afterPage` after each page of the walk (to keep its lease).
   */
  async dropLegacyAttributeSets(afterPage: () => Promise<unknown>): Promise<number> {
    const legacy = legacyAttributeSets(this.prefix);
    let dropped = 0;
    let cursor = '0';
    do {
      const [next, keys] = await this.command(() => this.redis.scan(cursor, 'MATCH', legacy.glob, 'COUNT', 1000, 'TYPE', 'set'));
      cursor = next;
      const old = keys.filter(legacy.matches);
      if (old.length > 0) dropped += await this.command(() => this.redis.unlink(...old));
      await afterPage();
    } while (cursor !== '0');
    return dropped;
  }

  async freeCount(pool: string): Promise<number> {
    return this.command(() => this.redis.zcard(poolKeys(this.prefix, pool).free));
  }

  /** The reservation id holding this item, an allocation tombstone ("A:<version>"), or null. */
  async holder(pool: string, resourceId: string): Promise<string | null> {
    return this.command(() => this.redis.get(poolKeys(this.prefix, pool).hold(resourceId)));
  }

  async markerPresent(): Promise<boolean> {
    return (await this.rebuildState()) !== 'missing';
  }

  /**
   * What the rebuilt-marker says: `missing` (Redis was wiped, or its key layout is new), `unfinished` (a
   * rebuild round began and no rebuild has ended since: one is running, or one failed or its instance died
   * midway, and part of the free index may be missing) or `rebuilt`.
   */
  async rebuildState(): Promise<'missing' | 'unfinished' | 'rebuilt'> {
    const marker = await this.marker();
    if (marker === null) return 'missing';
    return unfinishedRound(marker) === null ? 'rebuilt' : 'unfinished';
  }

  /** Drops the markers of older key layouts (legacyMarkerKeys), one key a command (they need not share a Cluster slot). */
  async dropLegacyMarkers(): Promise<void> {
    for (const key of legacyMarkerKeys(this.prefix)) await this.command(() => this.redis.unlink(key));
  }

  /** The rebuilt-marker's value, or null. */
  async marker(): Promise<string | null> {
    return this.command(() => this.redis.get(markerKey(this.prefix)));
  }

  /** True while the key of this rebuild round is there: Redis was not wiped since the round began. */
  async rebuildRoundKeyPresent(run: string): Promise<boolean> {
    return (await this.command(() => this.redis.exists(rebuildRunKey(this.prefix, run)))) === 1;
  }

  /** Writes the rebuilt-marker with this value. */
  async setMarker(value: string): Promise<void> {
    await this.command(() => this.redis.set(markerKey(this.prefix), value));
  }

  /**
   * Ends a rebuild: the marker becomes `value` only if it still holds `roundMarker`, the marker of the
   * rebuild's last round, in one step. False, and nothing written, if it does not: Redis was wiped since
   * that round began (a rebuilt-marker in an empty Redis would hide the wipe from every sweeper), or
   * another instance's rebuild has written its own since (it writes the marker when it ends).
   */
  async markRebuilt(roundMarker: string, value: string): Promise<boolean> {
    const reply = await this.command(() => this.redis.eval(MARK_REBUILT, 1, markerKey(this.prefix), roundMarker, value));
    return reply === 1;
  }

  /**
   * Starts a round of a rebuild: writes the marker, and the round's own key (see endRebuildRound). Not the
   * marker's value tells a wipe: an instance that stalled past its lease may still write that.
   */
  async startRebuildRound(run: string, marker: string): Promise<void> {
    // Two commands, not a MULTI: the keys need not share a Redis Cluster slot.
    await this.command(() => this.redis.set(rebuildRunKey(this.prefix, run), '1', 'PX', REBUILD_RUN_KEY_MS));
    await this.command(() => this.redis.set(markerKey(this.prefix), marker));
  }

  /** Ends a round of a rebuild; false if its key is gone: Redis was wiped during the round. */
  async endRebuildRound(run: string): Promise<boolean> {
    return (await this.command(() => this.redis.del(rebuildRunKey(this.prefix, run)))) === 1;
  }

  /** The rebuilt-marker and Redis' checkpoint (RebuildService.checkpoint), read at one instant. */
  async checkpoint(): Promise<RedisCheckpoint> {
    const [marker, n] = await this.command(() => this.redis.mget(markerKey(this.prefix), checkpointKey(this.prefix)));
    return { marker, n: n === null ? null : Number(n) };
  }

  /** Sets Redis' checkpoint to `n` if it and the marker are still as `seen`; false, and nothing written, if not. */
  async setCheckpoint(seen: RedisCheckpoint & { marker: string }, n: number): Promise<boolean> {
    const keys = [markerKey(this.prefix), checkpointKey(this.prefix)];
    const reply = await this.command(() =>
      this.redis.eval(SET_CHECKPOINT, 2, ...keys, seen.marker, seen.n === null ? '' : String(seen.n), String(n)),
    );
    return reply === 1;
  }

  /**
   * Drops the keys of `pools` and the marker, so that Redis is as after a wipe (see RebuildService, `rolledBack`):
   * first each pool's generation (a reserve there finds nothing from then on), then the pool's other keys as a walk of
   * the key space finds them, then the marker and the checkpoint, in one step. Each step is fenced against an instance
   * that stalled in it while another rebuilt Redis: a generation is dropped only if it is `generation` or older (read
   * before the caller found Redis behind; a rebuild since bumped it), a pool's keys only while it has no generation and
   * no rebuild is putting its Idempotency-Keys back, the marker only while it is as `seen`, and the checkpoint only
   * while it is still behind `postgres`, the Postgres checkpoint read with it (one started again since is not; a
   * stalled rebuild round may have written its own marker meanwhile). Until then, any instance still finds Redis
   * behind and starts over, should this one die midway. `afterPage` runs after each page of the walk (to keep the
   * rebuild's lease). Returns how many keys were dropped.
   */
  async dropAll(
    seen: RedisCheckpoint & { marker: string },
    postgres: number,
    generation: number,
    pools: readonly string[],
    afterPage: () => Promise<unknown>,
  ): Promise<number> {
    let dropped = 0;
    for (const pool of pools) {
      const keys = poolKeys(this.prefix, pool);
      dropped += (await this.command(() => this.redis.eval(DROP_GENERATION, 1, keys.generation, generation))) as number;
    }
    const found = poolKeysOf(this.prefix, pools);
    let cursor = '0';
    do {
      const [next, page] = await this.command(() => this.redis.scan(cursor, 'MATCH', found.glob, 'COUNT', 1000));
      cursor = next;
      const byPool = new Map<string, string[]>();
      for (const key of page) {
        const pool = found.poolOf(key);
        if (pool === null) continue;
        const list = byPool.get(pool);
        if (list) list.push(key);
        else byPool.set(pool, [key]);
      }
      for (const [pool, poolKeyNames] of byPool) {
        const { generation: gen, keysRound } = poolKeys(this.prefix, pool);
        const names = poolKeyNames.filter((key) => key !== gen && key !== keysRound);
        for (let i = 0; i < names.length; i += 500) {
          const chunk = names.slice(i, i + 500);
          const reply = (await this.command(() => this.redis.eval(DROP_POOL_KEYS, 2 + chunk.length, gen, keysRound, ...chunk))) as number;
          if (reply > 0) dropped += reply;
        }
      }
      await afterPage();
    } while (cursor !== '0');
    const last = (await this.command(() =>
      this.redis.eval(DROP_MARKER, 2, markerKey(this.prefix), checkpointKey(this.prefix), seen.marker, postgres),
    )) as number;
    return dropped + last;
  }

  /**
   * Runs `wait` (a reserve that waits: ReservationsService) so that the connection to Redis closes only after it: its
   * caller may have hung up, so that the HTTP server closes before its last try, give-back or leave has run.
   */
  whileOpen<T>(wait: Promise<T>): Promise<T> {
    const tracked = wait.then(
      () => undefined,
      () => undefined,
    );
    this.unfinished.add(tracked);
    void tracked.finally(() => this.unfinished.delete(tracked));
    return wait;
  }

  /** Runs after the HTTP server has finished its in-flight requests, and after the waits and leaves they began. */
  async onApplicationShutdown(): Promise<void> {
    while (this.unfinished.size > 0) await Promise.all(this.unfinished);
    await this.redis.quit().catch(() => this.redis.disconnect());
  }

  /**
   * Readiness: Redis answers, and may not evict keys. The policy is checked at start-up, and again here: a
   * Redis restarted or failed over with another configuration would otherwise go unnoticed.
   */
  async ready(): Promise<void> {
    const info = await this.command(() => this.redis.info('memory'));
    const refusal = evictionRefusal(new URL(this.config.REDIS_URL), evictionPolicyOf(info));
    if (refusal) throw new Error(refusal);
  }
}

/** The round of a rebuild the marker says is running or unfinished (`<generation> rebuilding:<round>`), or null. */
export function unfinishedRound(marker: string | null): string | null {
  const at = marker?.indexOf(REBUILDING) ?? -1;
  return at < 0 ? null : marker!.slice(at + REBUILDING.length);
}

/** A command ioredis refused to send (no connection, and no offline queue): it never reached Redis. */
function neverSent(err: DomainError): boolean {
  const cause = (err as { cause?: unknown }).cause;
  return cause instanceof Error && cause.message.startsWith("Stream isn't writeable");
}

export function compareIds(a: string, b: string): number {
  return a.length - b.length || (a < b ? -1 : a > b ? 1 : 0);
}
