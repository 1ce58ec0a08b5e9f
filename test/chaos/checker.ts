import type { Redis } from 'ioredis';
import pg from 'pg';
import { holdSnapshot } from '../support/hold-snapshot.js';
import { Exchange } from './clients.js';

export interface FaultWindow {
  kind: string;
  start: number;
  end: number;
  /**
   * Redis state was lost (flush, kill) at some moment between `start` and this time (when the flush answered,
   * or the kill had ended the old server). Holds a reserve sent before this time may have taken are not owed
   * to anyone: the reserve may have run before the loss. One sent later ran after it.
   */
  redisLostBy?: number;
  /**
   * Redis went back to a snapshot taken at `start`: what it was told from then until `redisLostBy` is lost, the
   * Idempotency-Keys of reservations made then too (the rebuild puts back those of confirmed ones).
   */
  rollback?: boolean;
  /** The instance that was paused or killed, if any. */
  instance?: string;
}

const GRACE_MS = 3000;
/**
 * The service owes a confirm only if it reaches it before expiresAt. A refusal with HOLD_LOST or HOLD_EXPIRED says
 * when the instance received the request (`details.receivedAt`; the same machine's clock as the client's and
 * Redis'): one received at or after expiresAt arrived late (a slow client loop, a busy machine) and is counted
 * (`arrivedLate`), not judged, unless an extension whose answer was lost may have moved expiresAt later than the
 * client knows. A refusal without it (another code) is judged by when the client sent it, except one
 * sent in the last LATE_SEND_MS and answered only after expiresAt, which may have arrived after it (`maybeLate`).
 */
const LATE_SEND_MS = 500;

/** When the instance received a request, as its HOLD_LOST or HOLD_EXPIRED answer says; undefined otherwise. */
function receivedAt(e: Exchange): number | undefined {
  const at = (e.answer as { error?: { details?: { receivedAt?: unknown } } } | undefined)?.error?.details?.receivedAt;
  return typeof at === 'string' ? Date.parse(at) : undefined;
}

/** Samples Redis during the run: an item in two live holds, or free while held, is a violation. */
export class HoldSampler {
  samples = 0;
  samplesWithHolds = 0;
  readonly violations: string[] = [];

  constructor(
    private readonly redis: Redis,
    private readonly bases: string[],
  ) {}

  async sample(): Promise<void> {
    for (const base of this.bases) {
      let snapshot: Awaited<ReturnType<typeof holdSnapshot>>;
      try {
        snapshot = await holdSnapshot(this.redis, base);
      } catch {
        return; // Redis is down or slow right now: nothing to sample
      }
      this.samples++;
      const { holders } = snapshot;
      if (holders.size > 0) this.samplesWithHolds++;
      for (const entry of snapshot.lost) {
        const [id, rid, holder] = entry.split(' ');
        this.violations.push(`item ${id} of reservation ${rid}, still due, is held by ${holder === 'false' ? 'nobody' : holder}`);
      }
      for (const id of snapshot.free) {
        if (holders.has(id)) this.violations.push(`item ${id} free while held by ${holders.get(id)}`);
      }
    }
  }
}

/**
 * Invariant 4, sampled during the run: an item free in Postgres is, in Redis, under a hold key (a live hold, a pinned
 * commit's, or an allocation's tombstone not yet replaced by its release's indexing) or in the pool's free index
 * (reservable). One seen neither for more than FLOW_LIMIT_MS, with no fault window overlapping that time (Redis lost or
 * unreachable: the rebuild puts it back; an instance killed between a release's Postgres and Redis steps), is a
 * violation. Postgres is read first, then Redis in one script: an item allocated between the two reads is under its
 * commit's hold or its tombstone in Redis.
 */
export class FlowSampler {
  /**
   * API.md's 2 s, and the time between two samples (about 2 s on the loaded machine: the suite's 1,000 clients share
   * its event loop) and the sweeper's lag under the suite's load. The longest an item was seen missing outside faults
   * in runs of unchanged code: 0-2.6 s in short runs, 3.0 s in a full one; with an expiry that frees nothing (the
   * periodic rebuild puts the items back within 10 s), 5.3-7.1 s.
   */
  static readonly FLOW_LIMIT_MS = 4500;
  samples = 0;
  /** The longest an item was seen neither held nor reservable with no fault window overlapping that time. */
  longestMissingMs = 0;
  readonly violations: string[] = [];
  /** Item ids seen free in Postgres and missing in Redis in every sample since the first that saw it so, and when that was. */
  private readonly missingSince = new Map<string, number>();
  private readonly reported = new Set<string>();
  private sql: pg.Client | undefined;

  constructor(
    private readonly redis: Redis,
    private readonly databaseUrl: string,
    /** Pool name to its Redis key base. */
    private readonly pools: Record<string, string>,
    private readonly windows: FaultWindow[],
  ) {}

  /** Whether a fault window overlaps the time from `from` to `to` (or its grace after it does). */
  private faulty(from: number, to: number): boolean {
    return this.windows.some((w) => w.start <= to && (w.end || Infinity) + GRACE_MS >= from);
  }

  async sample(): Promise<void> {
    const missing = new Set<string>();
    try {
      if (!this.sql) {
        const sql = new pg.Client({ connectionString: this.databaseUrl, connectionTimeoutMillis: 1000, query_timeout: 2000 });
        sql.on('error', () => (this.sql = undefined));
        await sql.connect();
        this.sql = sql;
      }
      for (const [pool, base] of Object.entries(this.pools)) {
        const free = await this.sql.query<{ id: string; value: string }>(
          `SELECT r.id::text AS id, r.value FROM t_resource r JOIN t_pool p ON p.id = r.pool_id WHERE r.state = 1 AND p.name = $1`,
          [pool],
        );
        const args = free.rows.flatMap((row) => [row.id, `${row.value}\0${row.id}`]);
        for (const id of (await this.redis.eval(UNACCOUNTED, 0, base, ...args)) as string[]) missing.add(id);
      }
    } catch {
      await this.sql?.end().catch(() => undefined);
      this.sql = undefined;
      // Postgres or Redis down or slow right now: nothing to sample, and no item is known to have stayed missing.
      this.missingSince.clear();
      return;
    }
    // When Redis was read: a sample may take a second or more on the loaded machine, and what it saw missing was
    // missing then (a fault that began after the sample did may be why).
    const at = Date.now();
    this.samples++;
    for (const id of this.missingSince.keys()) if (!missing.has(id)) this.missingSince.delete(id);
    for (const id of missing) {
      const since = this.missingSince.get(id) ?? at;
      this.missingSince.set(id, since);
      if (this.faulty(since, at)) continue;
      this.longestMissingMs = Math.max(this.longestMissingMs, at - since);
      if (at - since <= FlowSampler.FLOW_LIMIT_MS || this.reported.has(id)) continue;
      this.reported.add(id);
      this.violations.push(
        `item ${id}: free in Postgres, neither held nor reservable in Redis for ${at - since} ms (since ${new Date(since).toISOString()})`,
      );
    }
  }

  async close(): Promise<void> {
    await this.sql?.end().catch(() => undefined);
  }
}

/** ARGV: base, then pairs of an item id and its free-index member. Returns the ids under no hold key and not in the index. */
const UNACCOUNTED = `
local base = ARGV[1]
local out = {}
for i = 2, #ARGV, 2 do
  if redis.call('EXISTS', base .. 'h:' .. ARGV[i]) == 0 and not redis.call('ZSCORE', base .. 'free', ARGV[i + 1]) then
    out[#out + 1] = ARGV[i]
  end
end
return out`;

export interface Verdict {
  violations: string[];
  /** What helps explain the violations (the history of an item whose hold was not honoured); not counted. */
  diagnostics: string[];
  counts: Record<string, number>;
}

function inWindow(e: Exchange, windows: FaultWindow[]): FaultWindow | undefined {
  return windows.find((w) => e.sentAt <= w.end + GRACE_MS && e.doneAt >= w.start);
}

/** Checks every client's log and Postgres' history against the invariants. */
export async function check(log: Exchange[], windows: FaultWindow[], databaseUrl: string): Promise<Verdict> {
  const violations: string[] = [];
  const diagnostics: string[] = [];
  /** Items of holds that were not honoured: their whole story is printed to find out why. */
  const lostItems = new Set<string>();
  const counts: Record<string, number> = {
    requests: log.length,
    ok: 0,
    '503': 0,
    network: 0,
    hung: 0,
    /** No answer before the client's timeout from an instance that was stopped (SIGSTOP, kill -9) meanwhile. */
    hungWhileStopped: 0,
    '500': 0,
    excused: 0,
    arrivedLate: 0,
    /** The longest a confirm counted in arrivedLate took from the client to the service. */
    arrivedLateMaxLagMs: 0,
    maybeLate: 0,
  };
  for (const e of log) {
    if (e.status >= 200 && e.status < 300) counts.ok++;
    if (e.status === 503) counts['503']++;
    if (e.status === 0) counts.network++;
    if (e.status === -1) {
      // A stopped process answers nothing: a client that gave up on the paused instance before its fault was over
      // (the pause scenario lasts as long as the rival needs; on a busy machine, longer than the client's timeout)
      // was owed nothing yet. One that waited past the fault's end was.
      if (windows.some((w) => w.instance === e.instance && e.sentAt >= w.start && e.doneAt <= w.end)) counts.hungWhileStopped++;
      else {
        counts.hung++;
        violations.push(`hung: ${e.op} ${e.path} on ${e.instance} sent ${new Date(e.sentAt).toISOString()}`);
      }
    }
    if (e.status >= 500 && e.status !== 503) {
      counts['500']++;
      violations.push(`${e.status}: ${e.op} ${e.path} on ${e.instance}: ${JSON.stringify(e.answer)}`);
    }
    const fault = inWindow(e, windows);
    if ((e.status === 503 || e.status === 0) && !fault) {
      violations.push(
        `${e.status === 0 ? 'connection failed' : '503'} outside any fault: ${e.op} ${e.path} on ${e.instance} at ${new Date(e.sentAt).toISOString()}`,
      );
    }
    // Hold honoured: a confirm that arrived before expiresAt succeeds.
    if ((e.op === 'confirm' || e.op === 'complete') && e.expiresAt && e.sentAt < e.expiresAt && e.status !== 200) {
      const dependencyDown = (e.status === 503 || e.status === 0) && fault;
      const redisLost = windows.some(
        (w) => w.redisLostBy !== undefined && (e.reservationCreatedAt ?? 0) <= w.redisLostBy && w.start <= e.doneAt,
      );
      const instancePaused = windows.some((w) => w.instance === e.instance && e.sentAt <= w.end && e.doneAt >= w.start);
      const received = receivedAt(e);
      if (dependencyDown || redisLost || instancePaused) counts.excused++;
      else if (received !== undefined && received >= e.expiresAt && e.expiryKnown !== false) {
        counts.arrivedLate++;
        counts.arrivedLateMaxLagMs = Math.max(counts.arrivedLateMaxLagMs, received - e.sentAt);
        diagnostics.push(
          `arrived late, not judged: ${e.op} ${e.path} on ${e.instance}, sent ${e.expiresAt - e.sentAt} ms before expiry, received by the service ${received - e.expiresAt} ms after it: ${e.status} ${JSON.stringify(e.answer)}`,
        );
      } else if (received === undefined && e.expiresAt - e.sentAt < LATE_SEND_MS && e.doneAt > e.expiresAt) counts.maybeLate++;
      else {
        const arrival =
          received === undefined
            ? ''
            : `, received by the service ${received - e.sentAt} ms after it was sent (${e.expiresAt - received} ms before expiry)`;
        violations.push(
          `hold not honoured: ${e.op} ${e.path} sent at ${new Date(e.sentAt).toISOString()}, ${e.expiresAt - e.sentAt} ms before expiry, reserved at ${new Date(e.reservationCreatedAt ?? 0).toISOString()}, on ${e.instance}${arrival}, answered ${e.doneAt - e.sentAt} ms after it was sent: ${e.status} ${JSON.stringify(e.answer)}`,
        );
        for (const id of (e.answer as { error?: { details?: { resourceIds?: string[] } } })?.error?.details?.resourceIds ?? [])
          lostItems.add(id);
      }
    }
  }

  checkKeyedRetries(log, windows, violations, counts);

  const sql = new pg.Client({ connectionString: databaseUrl });
  await sql.connect();
  try {
    // Single allocation: per item, versions strictly increase and allocate/release alternate.
    const history = await sql.query<{ resource_id: string; action: string; version: number; reservation_id: string | null }>(
      `SELECT resource_id::text, action, version, reservation_id FROM t_allocation_history ORDER BY resource_id, id`,
    );
    counts.allocations = history.rows.filter((h) => h.action === 'allocate').length;
    for (const id of lostItems) {
      const rows = await sql.query<{ action: string; version: number; reservation_id: string | null; at: Date }>(
        `SELECT action, version, reservation_id, created_at AS at FROM t_allocation_history WHERE resource_id = $1 ORDER BY id`,
        [id],
      );
      const story = rows.rows.map((h) => {
        const requests = log
          .filter((r) => h.reservation_id && r.path.includes(h.reservation_id.split('.')[1] ?? h.reservation_id))
          .map(
            (r) =>
              `${r.op} on ${r.instance} ${new Date(r.sentAt).toISOString().slice(11, 23)}-${new Date(r.doneAt).toISOString().slice(11, 23)} -> ${r.status}`,
          );
        return `  ${h.action} v${h.version} ${h.at.toISOString().slice(11, 23)} by ${h.reservation_id}: ${requests.join('; ')}`;
      });
      const reserves = log
        .filter((r) => r.op === 'reserve' && r.status === 201 && JSON.stringify(r.answer).includes(`"resourceId":"${id}"`))
        .map((r) => `${(r.answer as { id: string }).id} on ${r.instance} at ${new Date(r.sentAt).toISOString().slice(11, 23)}`);
      diagnostics.push(`story of item ${id}:\n${story.join('\n')}\n  reserved by: ${reserves.join(', ')}`);
    }
    // Single allocation: per item, allocate and release alternate, starting with an allocation. (The versions Postgres
    // records are its own row's, incremented under the row's lock: their order is not checked, it cannot be wrong.)
    let previous: (typeof history.rows)[number] | undefined;
    for (const h of history.rows) {
      const first = !previous || previous.resource_id !== h.resource_id;
      if (first && h.action !== 'allocate') violations.push(`item ${h.resource_id}: history starts with ${h.action}`);
      if (!first && previous && h.action === previous.action) {
        violations.push(`item ${h.resource_id}: ${h.action} twice in a row (allocated twice?)`);
      }
      previous = h;
    }
    // Every allocation acknowledged to a client is in Postgres, at the version its answer gives, which is one more than
    // the version the reservation's hold was taken at (its reserve's answer): the version-checked update of invariant 2.
    const recorded = new Map(
      history.rows.filter((h) => h.action === 'allocate').map((h) => [`${h.reservation_id} ${h.resource_id}`, h.version]),
    );
    const heldAt = new Map<string, number>();
    for (const e of log) {
      if (e.op !== 'reserve' || e.status !== 201) continue;
      for (const item of e.answer.items as { resourceId: string; version: number }[])
        heldAt.set(`${e.answer.id} ${item.resourceId}`, item.version);
    }
    for (const e of log) {
      if (e.status !== 200) continue;
      if (e.op === 'confirm') {
        const rid = e.path.split('/')[3];
        for (const a of e.answer.allocated as { resourceId: string; version: number }[]) {
          const key = `${rid} ${a.resourceId}`;
          const version = recorded.get(key);
          if (version === undefined) violations.push(`acknowledged but not in Postgres: ${key}`);
          else if (version !== a.version) violations.push(`acknowledged at version ${a.version}, recorded at ${version}: ${key}`);
          const held = heldAt.get(key);
          if (held !== undefined && a.version !== held + 1) {
            violations.push(`allocated at version ${a.version} by a hold taken at version ${held}: ${key}`);
          }
        }
      }
      if (e.op === 'complete' && !recorded.has(`${e.answer.leaseId} ${e.answer.resourceId}`)) {
        violations.push(`acknowledged but not in Postgres: ${e.answer.leaseId} ${e.answer.resourceId}`);
      }
    }
    checkCommitAnswers(log, new Set(history.rows.filter((h) => h.action === 'allocate').map((h) => h.reservation_id!)), violations, counts);
  } finally {
    await sql.end();
  }
  return { violations, diagnostics, counts };
}

/**
 * Confirm and complete, per reservation (or lease): every `200` answer to it has the same body (idempotent: the same
 * call again returns the same body; the clients choose one item per reservation, and send it again only with the
 * same choice); and one all of whose attempts were refused (a 4xx, which says nothing was allocated) allocated
 * nothing. An attempt answered 503, or not at all, may have landed: such a reservation is not judged.
 */
function checkCommitAnswers(log: Exchange[], allocated: Set<string>, violations: string[], counts: Record<string, number>): void {
  const attempts = new Map<string, Exchange[]>();
  for (const e of log) {
    if (e.op !== 'confirm' && e.op !== 'complete') continue;
    const rid = e.path.split('/')[3];
    attempts.set(rid, [...(attempts.get(rid) ?? []), e]);
  }
  counts.commitsRepeated = 0;
  counts.commitsRefused = 0;
  for (const [rid, tries] of attempts) {
    const answered = tries.filter((e) => e.status === 200).map((e) => JSON.stringify(e.answer));
    if (answered.length > 1) counts.commitsRepeated++;
    if (new Set(answered).size > 1)
      violations.push(`${tries[0].op} of ${rid} answered 200 with different bodies: ${[...new Set(answered)].join(' / ')}`);
    if (answered.length === 0 && tries.every((e) => e.status >= 400 && e.status < 500)) {
      counts.commitsRefused++;
      if (allocated.has(rid)) {
        violations.push(
          `${tries[0].op} of ${rid} refused (${tries.map((e) => `${e.status} ${e.answer?.error?.code}`).join(', ')}), yet allocated in Postgres`,
        );
      }
    }
  }
}

/**
 * A keyed reserve sent again after its reservation was confirmed answers with that reservation: 200, the same id,
 * `confirmed`, also when Redis lost its data in between (the rebuild puts the key back from the commit). A 201 is a
 * second reservation for one order. Refusals (409 POOL_EXHAUSTED while a pool is being rebuilt, 503 in a fault) owe
 * nothing; 409 IDEMPOTENCY_KEY_REUSED for the same body never happens.
 */
function checkKeyedRetries(log: Exchange[], windows: FaultWindow[], violations: string[], counts: Record<string, number>): void {
  const confirmedAt = new Map<string, number>();
  for (const e of log) {
    if (e.op !== 'confirm' || e.status !== 200) continue;
    const rid = e.path.split('/')[3];
    confirmedAt.set(rid, Math.min(confirmedAt.get(rid) ?? Infinity, e.doneAt));
  }
  const reservationOf = new Map<string, string>();
  for (const e of log) if (e.op === 'reserve' && e.status === 201 && e.idempotencyKey) reservationOf.set(e.idempotencyKey, e.answer.id);
  counts.keyedRetries = 0;
  counts.keyedReplaysAcrossRedisLoss = 0;
  counts.keyedReplaysAcrossRollback = 0;
  for (const e of log) {
    if (e.op !== 'reserve-retry' || !e.idempotencyKey) continue;
    counts.keyedRetries++;
    const rid = reservationOf.get(e.idempotencyKey);
    const confirmed = rid === undefined ? undefined : confirmedAt.get(rid);
    if (rid === undefined || confirmed === undefined || confirmed > e.sentAt) continue;
    const answer = e.answer as { id?: string; state?: string; error?: { code?: string } } | undefined;
    // Those that Redis lost the key of in between (and the rebuild put back), answered with the reservation.
    if (e.status === 200 && windows.some((w) => w.redisLostBy !== undefined && w.start >= confirmed && w.redisLostBy <= e.sentAt)) {
      counts.keyedReplaysAcrossRedisLoss++;
    }
    // Those confirmed after the snapshot Redis went back to: the snapshot never had their key.
    if (
      e.status === 200 &&
      windows.some((w) => w.rollback && w.start <= confirmed && confirmed <= w.redisLostBy! && w.redisLostBy! <= e.sentAt)
    ) {
      counts.keyedReplaysAcrossRollback++;
    }
    if (e.status === 201 || (e.status === 200 && (answer?.id !== rid || answer?.state !== 'confirmed'))) {
      violations.push(
        `keyed reserve retried after its reservation ${rid} was confirmed made or named another: ${e.status} ${JSON.stringify(answer)} (key ${e.idempotencyKey}, sent ${new Date(e.sentAt).toISOString()})`,
      );
    }
    // Before the rebuild after a loss of Redis data gives the pool its generation (after the keys), a reserve there
    // finds nothing; at any other time the key is there and answers first.
    const rebuilding = windows.some((w) => w.redisLostBy !== undefined && e.sentAt <= w.end + GRACE_MS && e.doneAt >= w.start);
    if (e.status === 409 && answer?.error?.code === 'POOL_EXHAUSTED' && !rebuilding) {
      violations.push(
        `keyed reserve retried after its reservation ${rid} was confirmed answered POOL_EXHAUSTED outside a loss of Redis data (key ${e.idempotencyKey}, sent ${new Date(e.sentAt).toISOString()})`,
      );
    }
    if (e.status === 409 && answer?.error?.code === 'IDEMPOTENCY_KEY_REUSED') {
      violations.push(`keyed reserve retried with the same body refused as another body: key ${e.idempotencyKey}`);
    }
  }
}
