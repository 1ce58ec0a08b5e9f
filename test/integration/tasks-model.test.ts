/**
 * Randomized model-based test of review-task leases ("Review tasks" in API.md) on two instances.
 *
 * A reference model of one small task pool (tasks with and without a groupKey, optionally maxHoldsPerOwner) is
 * driven alongside the real service: pulls (POST /v1/pools/{pool}/tasks/next), heartbeats, completes, abandons,
 * releases of completed tasks, short leases that expire, late heartbeats and completes, and the same calls sent
 * to both instances at once. Every answer (status, error code, body) and the pool's stats are compared with the
 * model after each step; the groupKey affinity rule and the per-reviewer quota are judged on every pull. At the
 * end of a sequence every open lease is abandoned, the reviewers' quotas must be whole again (and Redis' per-owner
 * and per-group counters empty), and t_resource, t_allocation_history and t_commit are compared with the model.
 *   TASK_MODEL_SEEDS=7 npx vitest run test/integration/tasks-model.test.ts   (one seed, "1-8" or "3,9"; default 1-4)
 *   TASK_MODEL_STEPS=40                                                      (steps per sequence; default 30)
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { randomUUID } from 'node:crypto';
import { Redis } from 'ioredis';
import { HttpAnswer, TestInstance, TestWorld, sleep } from '../support/harness.js';
import { REDIS_URL } from '../support/services.js';
import { Rng } from '../support/random.js';
import { judge, mismatches, parseSeeds } from '../support/model.js';

// ---------- the model ----------
interface MTask {
  id: string;
  value: string;
  group: string | null;
  version: number;
  state: 'free' | 'held' | 'allocated';
  owner: string | null; // set when allocated
  holder: string | null; // lease id while leased
  allocations: { owner: string; version: number; leaseId: string }[];
}
type LState = 'live' | 'completed' | 'abandoned' | 'expired';
interface MLease {
  id: string;
  reviewer: string;
  taskId: string;
  version: number; // the task's version when leased
  state: LState;
  expiresAt: number;
  completeBody?: unknown;
}

const REVIEWERS = ['r-1', 'r-2', 'r-3'];
const GROUPS = ['ga', 'gb', 'gc'];
const LEASE_ID = /^[a-z0-9][a-z0-9_-]{0,62}\.[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/;
/** Tolerance on expiresAt = now + leaseMs (the service uses Redis' clock, the test its own). */
const SLACK_MS = 200;
/** A lease past its expiresAt by this much has been swept: its task is free again (API.md: within 2 s). */
const SWEPT_AFTER_MS = 2100;

interface SeqConfig {
  n: number;
  maxHoldsPerOwner?: number;
  maxHoldTtlMs: number;
  holdTtlMs: number;
}

async function runSequence(
  world: TestWorld,
  apis: TestInstance[],
  redis: Redis,
  seed: number,
  steps: number,
  coverage: Map<string, number>,
) {
  const rng = new Rng(seed * 104729 + 31);
  const cfg: SeqConfig = {
    n: rng.int(6, 10),
    maxHoldsPerOwner: rng.chance(0.5) ? rng.int(2, 3) : undefined,
    maxHoldTtlMs: rng.pick([1_200_000, 3_600_000]),
    holdTtlMs: rng.pick([600_000, 900_000]),
  };
  const pool = `tm-${seed}-${randomUUID().slice(0, 6)}`;
  const history: string[] = [];
  const log = (s: string) => history.push(s);
  log(`pool ${pool} config ${JSON.stringify(cfg)}`);

  const created = await apis[0].post('/v1/pools', {
    name: pool,
    kind: 'task',
    holdTtlMs: cfg.holdTtlMs,
    maxHoldTtlMs: cfg.maxHoldTtlMs,
    ...(cfg.maxHoldsPerOwner !== undefined && { maxHoldsPerOwner: cfg.maxHoldsPerOwner }),
  });
  expect(created.status, JSON.stringify(created.body)).toBe(201);
  const imports = Array.from({ length: cfg.n }, (_, i) => {
    const group = rng.chance(0.2) ? null : rng.pick(GROUPS);
    return { value: `task-${seed}-${i}`, ...(group !== null && { groupKey: group }) };
  });
  // A 503 changed nothing (API.md), so the import is sent again: a shared machine's Redis may stall a moment.
  let imported = await apis[0].post(`/v1/pools/${pool}/resources`, { items: imports });
  for (let attempt = 1; imported.status === 503 && attempt < 3; attempt++) {
    await sleep(500);
    imported = await apis[0].post(`/v1/pools/${pool}/resources`, { items: imports });
  }
  expect(imported.body).toEqual({ inserted: cfg.n, duplicates: 0 });
  const rows = await world.query<{ id: string; value: string; group_key: string | null }>(
    `SELECT r.id::text AS id, r.value, r.group_key FROM t_resource r JOIN t_pool p ON p.id = r.pool_id WHERE p.name = $1 ORDER BY r.id`,
    [pool],
  );
  const tasks = new Map<string, MTask>(
    rows.map((r) => [
      r.id,
      { id: r.id, value: r.value, group: r.group_key, version: 0, state: 'free', owner: null, holder: null, allocations: [] },
    ]),
  );
  const leases = new Map<string, MLease>();
  let shortBatches = 0;

  const { fail, api, short, errCode, expectStatus } = judge({
    seed,
    steps,
    replay: ['TASK_MODEL_SEEDS', 'TASK_MODEL_STEPS'],
    history,
    rng,
    apis,
  });
  const expectExpiry = (step: number, iso: unknown, sentAt: number, answeredAt: number, ttl: number, what: string) => {
    const exp = typeof iso === 'string' ? Date.parse(iso) : NaN;
    if (Number.isNaN(exp) || exp < sentAt + ttl - SLACK_MS || exp > answeredAt + ttl + SLACK_MS)
      fail(step, `${what}: expiresAt ${String(iso)} is not now + ${ttl} ms`);
    return exp;
  };

  const live = () => [...leases.values()].filter((l) => l.state === 'live');
  const liveOf = (reviewer: string) => live().filter((l) => l.reviewer === reviewer);
  const freeTasks = () => [...tasks.values()].filter((t) => t.state === 'free');
  const quotaFull = (reviewer: string, extra = 0) =>
    cfg.maxHoldsPerOwner !== undefined && liveOf(reviewer).length + extra >= cfg.maxHoldsPerOwner;

  const checkStats = async (step: number) => {
    const { i, a } = api();
    const r = await a.get(`/v1/pools/${pool}`);
    const all = [...tasks.values()];
    const want = {
      total: cfg.n,
      free: all.filter((t) => t.state === 'free').length,
      held: all.filter((t) => t.state === 'held').length,
      allocated: all.filter((t) => t.state === 'allocated').length,
    };
    if (r.status !== 200 || JSON.stringify(r.body?.stats) !== JSON.stringify(want)) {
      log(`  stats@${i} -> ${short(r)}`);
      fail(step, `stats ${JSON.stringify(r.body?.stats)} != model ${JSON.stringify(want)}`);
    }
  };

  /** The model's side of a lease that ended without a completion: its task is free again if it still held it. */
  const letGo = (l: MLease, state: 'abandoned' | 'expired') => {
    const t = tasks.get(l.taskId)!;
    if (t.holder === l.id) {
      t.state = 'free';
      t.holder = null;
    }
    l.state = state;
  };

  /** Leases whose expiresAt passed long enough ago have been swept: expired, their tasks free (invariant 4). */
  const applyExpiry = () => {
    const now = Date.now();
    for (const l of live()) if (l.expiresAt + SWEPT_AFTER_MS < now) letGo(l, 'expired');
  };
  const waitPast = async (expiresAt: number) => {
    const ms = expiresAt + SWEPT_AFTER_MS + 100 - Date.now();
    if (ms > 0) await sleep(ms);
    applyExpiry();
  };

  // ---------- operations ----------

  /** Judges a 200 lease against the model (the task was free) and records it; returns the lease. */
  const took = (step: number, r: HttpAnswer, reviewer: string, ttl: number, sentAt: number, answeredAt: number): MLease => {
    const b = r.body;
    const keys = Object.keys(b ?? {})
      .sort()
      .join(',');
    if (keys !== 'attributes,expiresAt,groupKey,leaseId,resourceId,value') fail(step, `lease body fields: ${keys}`);
    if (typeof b.leaseId !== 'string' || !LEASE_ID.test(b.leaseId) || !b.leaseId.startsWith(`${pool}.`))
      fail(step, `leaseId ${b.leaseId} is not an opaque id of this pool`);
    if (leases.has(b.leaseId)) fail(step, `leaseId ${b.leaseId} given twice`);
    const t = tasks.get(b.resourceId);
    if (!t) return fail(step, `lease of unknown task ${b.resourceId}`);
    if (t.state !== 'free')
      fail(step, `task ${t.id} leased to ${reviewer} while the model has it ${t.state} (${t.holder ?? t.owner}): two holders at once`);
    if (b.value !== t.value || b.groupKey !== t.group || JSON.stringify(b.attributes) !== '{}')
      fail(step, `lease body ${JSON.stringify(b)} != task ${JSON.stringify({ value: t.value, groupKey: t.group })}`);
    const exp = expectExpiry(step, b.expiresAt, sentAt, answeredAt, ttl, 'lease');
    t.state = 'held';
    t.holder = b.leaseId;
    const l: MLease = { id: b.leaseId, reviewer, taskId: t.id, version: t.version, state: 'live', expiresAt: exp };
    leases.set(l.id, l);
    return l;
  };

  /** The groups where the reviewer holds a live lease and a task is free: API.md says one of those comes first. */
  const affinityGroups = (reviewer: string) => {
    const held = new Set(
      liveOf(reviewer)
        .map((l) => tasks.get(l.taskId)!.group)
        .filter((g): g is string => g !== null),
    );
    return new Set(
      freeTasks()
        .filter((t) => t.group !== null && held.has(t.group))
        .map((t) => t.group!),
    );
  };

  const next = async (step: number, reviewer: string, leaseMs: number | undefined, note = '') => {
    const { i, a } = api();
    const preferred = affinityGroups(reviewer);
    const sentAt = Date.now();
    const r = await a.post(`/v1/pools/${pool}/tasks/next`, leaseMs === undefined ? { reviewer } : { reviewer, leaseMs });
    const answeredAt = Date.now();
    log(`next@${i}${note} ${reviewer} leaseMs=${leaseMs} (prefers [${[...preferred]}]) -> ${short(r)}`);
    if (quotaFull(reviewer)) {
      expectStatus(step, r, [[429, 'OWNER_QUOTA_EXCEEDED']]);
      const held = liveOf(reviewer).length;
      if (Number(r.body.error.details?.held) !== held || r.body.error.details?.maxHoldsPerOwner !== cfg.maxHoldsPerOwner)
        fail(step, `quota details ${JSON.stringify(r.body.error.details)}, model: holds ${held} of ${cfg.maxHoldsPerOwner}`);
      return null;
    }
    if (freeTasks().length === 0) {
      expectStatus(step, r, [[204]]);
      if (r.body !== undefined) fail(step, `204 with a body: ${JSON.stringify(r.body)}`);
      return null;
    }
    expectStatus(step, r, [[200]]);
    const l = took(step, r, reviewer, leaseMs ?? cfg.holdTtlMs, sentAt, answeredAt);
    const group = tasks.get(l.taskId)!.group;
    if (preferred.size > 0) coverage.set('affinityJudged', (coverage.get('affinityJudged') ?? 0) + 1);
    if (preferred.size > 0 && (group === null || !preferred.has(group)))
      fail(step, `affinity: ${reviewer} leases in [${[...preferred]}] where tasks are free, and was given a task of group ${group}`);
    return l;
  };

  const heartbeat = async (step: number, l: MLease, leaseMs: number | undefined) => {
    const { i, a } = api();
    const sentAt = Date.now();
    const r = await a.post(`/v1/tasks/${l.id}/heartbeat`, leaseMs === undefined ? {} : { leaseMs });
    const answeredAt = Date.now();
    log(`heartbeat@${i} ${l.id.slice(-6)} (model ${l.state}) leaseMs=${leaseMs} -> ${short(r)}`);
    if (l.state === 'expired') return expectStatus(step, r, [[409, 'HOLD_EXPIRED']]);
    if (l.state !== 'live')
      return expectStatus(step, r, [
        [409, 'RESERVATION_CLOSED'],
        [409, 'HOLD_EXPIRED'],
      ]);
    expectStatus(step, r, [[200]]);
    const keys = Object.keys(r.body).sort().join(',');
    if (keys !== 'expiresAt,leaseId' || r.body.leaseId !== l.id) fail(step, `heartbeat body ${JSON.stringify(r.body)}`);
    const ttl = Math.min(leaseMs ?? cfg.holdTtlMs, cfg.maxHoldTtlMs);
    l.expiresAt = expectExpiry(step, r.body.expiresAt, sentAt, answeredAt, ttl, 'heartbeat');
  };

  /** What a complete of `l` must answer now, per API.md; applies it to the model on a 200. */
  const judgeComplete = (step: number, l: MLease, r: HttpAnswer) => {
    const t = tasks.get(l.taskId)!;
    if (l.state === 'completed') {
      expectStatus(step, r, [[200]]);
      if (JSON.stringify(r.body) !== JSON.stringify(l.completeBody))
        fail(step, `complete again answered ${JSON.stringify(r.body)}, the first time ${JSON.stringify(l.completeBody)}`);
      return;
    }
    if (l.state === 'abandoned') return expectStatus(step, r, [[409, 'RESERVATION_CLOSED']]);
    if (l.state === 'expired') coverage.set('completeExpired', (coverage.get('completeExpired') ?? 0) + 1);
    if (l.state === 'expired' && (t.state !== 'free' || t.version !== l.version))
      return expectStatus(step, r, [
        [409, 'HOLD_LOST'],
        [409, 'HOLD_EXPIRED'],
      ]);
    expectStatus(step, r, [[200]]);
    const want = { leaseId: l.id, resourceId: l.taskId, state: 'completed' };
    if (JSON.stringify(r.body) !== JSON.stringify(want)) fail(step, `complete body ${JSON.stringify(r.body)} != ${JSON.stringify(want)}`);
    t.state = 'allocated';
    t.owner = l.reviewer;
    t.holder = null;
    t.version = l.version + 1;
    t.allocations.push({ owner: l.reviewer, version: t.version, leaseId: l.id });
    l.state = 'completed';
    l.completeBody = r.body;
  };

  const complete = async (step: number, l: MLease, note = '') => {
    const { i, a } = api();
    const r = await a.post(`/v1/tasks/${l.id}/complete`);
    log(`complete@${i}${note} ${l.id.slice(-6)} task ${l.taskId} (model ${l.state}) -> ${short(r)}`);
    judgeComplete(step, l, r);
  };

  const abandon = async (step: number, l: MLease) => {
    const { i, a } = api();
    const r = await a.post(`/v1/tasks/${l.id}/abandon`);
    log(`abandon@${i} ${l.id.slice(-6)} task ${l.taskId} (model ${l.state}) -> ${short(r)}`);
    if (l.state === 'completed') return expectStatus(step, r, [[409, 'RESERVATION_CLOSED']]);
    // An expired lease: API.md does not say; 200 (nothing left to give back) or 409 HOLD_EXPIRED, changing nothing.
    if (l.state === 'expired') {
      expectStatus(step, r, [[200], [409, 'HOLD_EXPIRED']]);
      if (r.status === 409) return;
    } else expectStatus(step, r, [[200]]);
    const want = { leaseId: l.id, resourceId: l.taskId, state: 'abandoned' };
    if (JSON.stringify(r.body) !== JSON.stringify(want)) fail(step, `abandon body ${JSON.stringify(r.body)} != ${JSON.stringify(want)}`);
    if (l.state !== 'abandoned') letGo(l, 'abandoned');
  };

  const releaseTask = async (step: number, t: MTask, owner: string) => {
    const { i, a } = api();
    const r = await a.post(`/v1/pools/${pool}/resources/${t.id}/release`, { owner });
    log(`release@${i} task ${t.id} by ${owner} (model ${t.state}/${t.owner}/v${t.version}) -> ${short(r)}`);
    if (t.state !== 'allocated' || t.owner !== owner) return expectStatus(step, r, [[409, 'NOT_ALLOCATED']]);
    expectStatus(step, r, [[200]]);
    t.state = 'free';
    t.owner = null;
    t.version += 1;
    if (r.body.state !== 'free' || r.body.version !== t.version || r.body.groupKey !== t.group)
      fail(step, `release body ${JSON.stringify(r.body)}, model v${t.version}`);
  };

  const getTask = async (step: number, t: MTask) => {
    const { i, a } = api();
    const r = await a.get(`/v1/pools/${pool}/resources/${t.id}`);
    log(`get-task@${i} ${t.id} (model ${t.state}/${t.owner}/v${t.version}) -> ${short(r)}`);
    expectStatus(step, r, [[200]]);
    const b = r.body;
    if (b.state !== t.state || b.version !== t.version || b.owner !== t.owner || b.groupKey !== t.group)
      fail(step, `task ${JSON.stringify(b)} != model ${JSON.stringify({ state: t.state, version: t.version, owner: t.owner })}`);
  };

  /**
   * Short leases (leaseMs 1000-1500) that run out: one of them may be heartbeaten in time (kept), heartbeaten too
   * late (409 HOLD_EXPIRED), or completed just after its expiresAt with nobody having taken its task (200, API.md's
   * confirm guarantee); then the test waits until the others have been swept (their tasks free within 2 s).
   */
  const shortBatch = async (step: number) => {
    shortBatches++;
    const batch: MLease[] = [];
    // Room for the short leases: a task free, reviewers under their quota.
    if (freeTasks().length === 0 && live().length > 0) await abandon(step, rng.pick(live()));
    const roomy = REVIEWERS.filter((r) => !quotaFull(r));
    for (const reviewer of (roomy.length > 0 ? roomy : REVIEWERS).slice(0, rng.int(1, 2))) {
      const l = await next(step, reviewer, rng.int(1000, 1500), ' short');
      if (l) batch.push(l);
    }
    await checkStats(step);
    if (batch.length === 0) return;
    const target = rng.pick(batch);
    const mode = rng.pick(['keep', 'lateBeat', 'lateComplete', 'expire'] as const);
    log(`short batch: ${mode} ${target.id.slice(-6)}`);
    if (mode === 'keep') {
      await heartbeat(step, target, rng.pick([undefined, 900_000]));
    } else if (mode === 'lateBeat') {
      const ms = target.expiresAt + rng.int(50, 300) - Date.now();
      if (ms > 0) await sleep(ms);
      // Past expiresAt (perhaps not swept yet): API.md says 409 HOLD_EXPIRED.
      const { i, a } = api();
      const r = await a.post(`/v1/tasks/${target.id}/heartbeat`, { leaseMs: 60_000 });
      log(`heartbeat@${i} late ${target.id.slice(-6)} at expiresAt + ${Date.now() - target.expiresAt} ms -> ${short(r)}`);
      expectStatus(step, r, [[409, 'HOLD_EXPIRED']]);
    } else if (mode === 'lateComplete') {
      const ms = target.expiresAt + rng.int(50, 400) - Date.now();
      if (ms > 0) await sleep(ms);
      log(`(sent at expiresAt + ${Date.now() - target.expiresAt} ms)`);
      // Nobody else acts meanwhile: the task is still this lease's to complete.
      await complete(step, target, ' late');
    }
    const due = batch.filter((l) => l.state === 'live' && l.expiresAt < Date.now() + 5000);
    if (due.length > 0) await waitPast(Math.max(...due.map((l) => l.expiresAt)));
    for (const l of due) if (l.state !== 'expired') fail(step, `lease ${l.id.slice(-6)} should have expired in the model`);
    await checkStats(step);
    // Then each expired lease is completed late (API.md: succeeds while nobody took its task), abandoned, heartbeaten
    // (409 HOLD_EXPIRED); another reviewer may pull first.
    for (const l of due) {
      coverage.set('expiredLease', (coverage.get('expiredLease') ?? 0) + 1);
      if (rng.chance(0.3)) await next(step, rng.pick(REVIEWERS.filter((r) => r !== l.reviewer)), undefined, ' meanwhile');
      const what = rng.weighted<'complete' | 'abandon' | 'heartbeat'>([
        [3, 'complete'],
        [1, 'abandon'],
        [1, 'heartbeat'],
      ]);
      if (what === 'complete') await complete(step, l, ' after-expiry');
      else if (what === 'abandon') await abandon(step, l);
      else if (what === 'heartbeat') await heartbeat(step, l, 60_000);
    }
  };

  // ---------- the random walk ----------
  const leaseChoices = [undefined, undefined, 900_000];
  for (let step = 0; step < steps; step++) {
    const all = [...leases.values()];
    const open = live();
    const ended = all.filter((l) => l.state !== 'live');
    const allocated = [...tasks.values()].filter((t) => t.state === 'allocated');
    const op = rng.weighted<string>([
      [18, 'next'],
      [4, 'nextPair'],
      [3, 'nextSame'],
      [open.length ? 6 : 0, 'heartbeat'],
      [ended.length ? 3 : 0, 'heartbeatEnded'],
      [open.length ? 10 : 0, 'complete'],
      [ended.length ? 5 : 0, 'completeEnded'],
      [open.length ? 3 : 0, 'parComplete'],
      [open.length ? 3 : 0, 'parCompleteAbandon'],
      [open.length ? 8 + Math.max(0, 4 - freeTasks().length) : 0, 'abandon'],
      [ended.length ? 3 : 0, 'abandonEnded'],
      [allocated.length ? 5 : 0, 'releaseOwner'],
      [allocated.length ? 1 : 0, 'releaseOther'],
      [3, 'getTask'],
      [1, 'unknownLease'],
      [shortBatches < 2 ? 4 : 0, 'shortBatch'],
    ]);
    coverage.set(op, (coverage.get(op) ?? 0) + 1);
    switch (op) {
      case 'next':
        await next(step, rng.pick(REVIEWERS), rng.pick(leaseChoices));
        break;
      case 'nextPair': {
        // Two reviewers pull at once, one on each instance: never the same task.
        const [r0, r1] = [rng.pick(REVIEWERS), rng.pick(REVIEWERS)];
        if (r0 === r1) {
          await next(step, r0, undefined);
          break;
        }
        const free = freeTasks().length;
        const sentAt = Date.now();
        const answers = await Promise.all([r0, r1].map((rv, i) => apis[i].post(`/v1/pools/${pool}/tasks/next`, { reviewer: rv })));
        const answeredAt = Date.now();
        log(`next-pair ${r0}@0 | ${r1}@1 (free ${free}) -> ${answers.map(short).join(' | ')}`);
        const full = [quotaFull(r0), quotaFull(r1)];
        const wanting = full.filter((f) => !f).length;
        answers.forEach((r, i) => {
          if (full[i]) expectStatus(step, r, [[429, 'OWNER_QUOTA_EXCEEDED']]);
          else expectStatus(step, r, [[200], [204]]);
        });
        const got = answers.filter((r) => r.status === 200).length;
        if (got !== Math.min(wanting, free))
          fail(step, `two pulls at once with ${free} tasks free: ${got} leases, expected ${Math.min(wanting, free)}`);
        answers.forEach((r, i) => {
          if (r.status === 200) took(step, r, [r0, r1][i], cfg.holdTtlMs, sentAt, answeredAt);
        });
        break;
      }
      case 'nextSame': {
        // One reviewer pulls twice at once on both instances: the quota and the free count both hold.
        const rv = rng.pick(REVIEWERS);
        const free = freeTasks().length;
        const heldBefore = liveOf(rv).length;
        const room = cfg.maxHoldsPerOwner === undefined ? 2 : Math.max(0, cfg.maxHoldsPerOwner - heldBefore);
        const sentAt = Date.now();
        const answers = await Promise.all(apis.map((a) => a.post(`/v1/pools/${pool}/tasks/next`, { reviewer: rv })));
        const answeredAt = Date.now();
        log(`next-same ${rv} on both (free ${free}, quota room ${room}) -> ${answers.map(short).join(' | ')}`);
        const want = Math.min(2, free, room);
        const got = answers.filter((r) => r.status === 200);
        if (got.length !== want) fail(step, `${rv} pulled twice at once: ${got.length} leases, expected ${want}`);
        const refusal: [number, string?] = quotaFull(rv, want) ? [429, 'OWNER_QUOTA_EXCEEDED'] : [204];
        for (const r of answers) if (r.status !== 200) expectStatus(step, r, [refusal]);
        for (const r of got) took(step, r, rv, cfg.holdTtlMs, sentAt, answeredAt);
        break;
      }
      case 'heartbeat':
        await heartbeat(step, rng.pick(open), rng.pick([undefined, 60_000, 900_000, 5_000_000]));
        break;
      case 'heartbeatEnded':
        await heartbeat(step, rng.pick(ended), 60_000);
        break;
      case 'complete':
        await complete(step, rng.pick(open));
        break;
      case 'completeEnded':
        await complete(step, rng.pick(ended), ' ended');
        break;
      case 'parComplete': {
        const l = rng.pick(open);
        const answers = await Promise.all(apis.map((a) => a.post(`/v1/tasks/${l.id}/complete`)));
        log(`par-complete ${l.id.slice(-6)} -> ${answers.map(short).join(' | ')}`);
        if (answers.some((r) => r.status !== 200)) fail(step, `the same complete on both instances at once: both must be 200`);
        if (JSON.stringify(answers[0].body) !== JSON.stringify(answers[1].body))
          fail(step, `the same complete twice at once: bodies differ`);
        judgeComplete(step, l, answers[0]);
        break;
      }
      case 'parCompleteAbandon': {
        const l = rng.pick(open);
        const flip = rng.int(0, 1);
        const [c, d] = await Promise.all([apis[flip].post(`/v1/tasks/${l.id}/complete`), apis[1 - flip].post(`/v1/tasks/${l.id}/abandon`)]);
        log(`par-complete-abandon ${l.id.slice(-6)} complete -> ${short(c)} | abandon -> ${short(d)}`);
        if (c.status === 200 && d.status === 409 && errCode(d) === 'RESERVATION_CLOSED') judgeComplete(step, l, c);
        else if (d.status === 200 && c.status === 409 && errCode(c) === 'RESERVATION_CLOSED') {
          if (JSON.stringify(d.body) !== JSON.stringify({ leaseId: l.id, resourceId: l.taskId, state: 'abandoned' }))
            fail(step, `abandon body ${JSON.stringify(d.body)}`);
          letGo(l, 'abandoned');
        } else fail(step, `complete and abandon at once: not (200, 409 RESERVATION_CLOSED) nor (409 RESERVATION_CLOSED, 200)`);
        break;
      }
      case 'abandon':
        await abandon(step, rng.pick(open));
        break;
      case 'abandonEnded':
        await abandon(step, rng.pick(ended));
        break;
      case 'releaseOwner': {
        const t = rng.pick(allocated);
        await releaseTask(step, t, t.owner!);
        break;
      }
      case 'releaseOther': {
        const t = rng.pick(allocated);
        await releaseTask(step, t, rng.pick(REVIEWERS.filter((r) => r !== t.owner)));
        break;
      }
      case 'getTask':
        await getTask(step, rng.pick([...tasks.values()]));
        break;
      case 'unknownLease': {
        const { i, a } = api();
        const path = rng.pick(['heartbeat', 'complete', 'abandon']);
        const r = await a.post(`/v1/tasks/${pool}.${randomUUID()}/${path}`);
        log(`${path}-unknown@${i} -> ${short(r)}`);
        expectStatus(step, r, [[404, 'RESERVATION_NOT_FOUND']]);
        break;
      }
      case 'shortBatch':
        await shortBatch(step);
        break;
    }
    await checkStats(step);
  }

  // ---------- at the end: every open lease abandoned, quotas whole again, Postgres ----------
  const end = steps;
  for (const l of live()) await abandon(end, l);
  await checkStats(end);
  if (cfg.maxHoldsPerOwner !== undefined) {
    // Nobody leases anything now: each reviewer may hold maxHoldsPerOwner tasks again (as many as are free).
    for (const reviewer of REVIEWERS) {
      const pulled: MLease[] = [];
      for (let k = 0; k < Math.min(cfg.maxHoldsPerOwner, freeTasks().length); k++) {
        const l = await next(end, reviewer, undefined, ' quota-check');
        if (l) pulled.push(l);
      }
      for (const l of pulled) await abandon(end, l);
    }
    await checkStats(end);
  }
  // No lease is open now, so no reviewer may still count in the pool's per-owner and per-group counters: what is left
  // there would turn a reviewer away with 429 (oh) or steer its pulls to a group it no longer works in (og).
  const base = `${world.prefix}{${pool}}:`;
  const counted: Record<string, unknown> = {};
  const oh = await redis.hgetall(`${base}oh`);
  if (Object.keys(oh).length > 0) counted.oh = oh;
  for (const reviewer of REVIEWERS) {
    const og = await redis.hgetall(`${base}og:${reviewer}`);
    if (Object.keys(og).length > 0) counted[`og:${reviewer}`] = og;
  }
  if (Object.keys(counted).length > 0) fail(end, `with no lease open, Redis still counts: ${JSON.stringify(counted)}`);

  const db = await world.query<{ id: string; state: number; version: number; owner: string | null }>(
    `SELECT r.id::text AS id, r.state, r.version, r.owner FROM t_resource r JOIN t_pool p ON p.id = r.pool_id WHERE p.name = $1`,
    [pool],
  );
  for (const row of db) {
    const t = tasks.get(row.id)!;
    const want = { state: t.state === 'allocated' ? 2 : 1, version: t.version, owner: t.state === 'allocated' ? t.owner : null };
    const got = { state: row.state, version: row.version, owner: row.owner };
    if (JSON.stringify(got) !== JSON.stringify(want))
      fail(end, `t_resource ${row.id}: ${JSON.stringify(got)} != model ${JSON.stringify(want)}`);
  }
  const history2 = await world.query<{ id: string; owner: string; version: number; reservation_id: string }>(
    `SELECT h.resource_id::text AS id, h.owner, h.version, h.reservation_id FROM t_allocation_history h JOIN t_pool p ON p.id = h.pool_id
     WHERE p.name = $1 AND h.action = 'allocate' ORDER BY h.id`,
    [pool],
  );
  const wantHistory = [...tasks.values()].flatMap((t) => t.allocations.map((a) => `${t.id}:${a.owner}:${a.version}:${a.leaseId}`)).sort();
  const gotHistory = history2.map((h) => `${h.id}:${h.owner}:${h.version}:${h.reservation_id}`).sort();
  if (JSON.stringify(gotHistory) !== JSON.stringify(wantHistory))
    fail(end, `allocation history ${JSON.stringify(gotHistory)} != model ${JSON.stringify(wantHistory)}`);
  const commits = await world.query<{ reservation_id: string; ids: string[] }>(
    `SELECT c.reservation_id, c.resource_ids::text[] AS ids FROM t_commit c JOIN t_pool p ON p.id = c.pool_id WHERE p.name = $1`,
    [pool],
  );
  const wantCommits = [...leases.values()]
    .filter((l) => l.state === 'completed')
    .map((l) => `${l.id}:${l.taskId}`)
    .sort();
  const gotCommits = commits.map((c) => `${c.reservation_id}:${c.ids.join(',')}`).sort();
  if (JSON.stringify(gotCommits) !== JSON.stringify(wantCommits))
    fail(end, `t_commit ${JSON.stringify(gotCommits)} != completed leases ${JSON.stringify(wantCommits)}`);
}

describe('model-based: review-task leases against API.md, on two instances', () => {
  // A Redis shared with other work may stall for a second now and then: no 503 for that.
  const world = new TestWorld('tmodel', { REDIS_TIMEOUT_MS: '10000' });
  const apis: TestInstance[] = [];
  let redis: Redis;
  beforeAll(async () => {
    apis.push(await world.start());
    apis.push(await world.start());
    redis = new Redis(REDIS_URL);
  });
  afterAll(async () => {
    redis?.disconnect();
    await world.cleanup();
  });

  it('random pulls, heartbeats, completes, abandons, releases and expiries agree with the model', async () => {
    const seeds = parseSeeds(process.env.TASK_MODEL_SEEDS ?? '1-4');
    const steps = Number(process.env.TASK_MODEL_STEPS ?? 30);
    const coverage = new Map<string, number>();
    const failures = await mismatches(seeds, (seed) => runSequence(world, apis, redis, seed, steps, coverage));
    expect(failures).toEqual([]);
    if (seeds.length * steps >= 100) {
      // The walk reached what it is for: pulls judged by the affinity rule, and leases that ran out.
      expect(coverage.get('affinityJudged') ?? 0, JSON.stringify(Object.fromEntries(coverage))).toBeGreaterThan(0);
      expect(coverage.get('expiredLease') ?? 0, JSON.stringify(Object.fromEntries(coverage))).toBeGreaterThan(0);
    }
  }, 600_000);
});
