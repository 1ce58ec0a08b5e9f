import { readdirSync, readFileSync } from 'node:fs';

/**
 * CPU time by process group from /proc, to say which process a run's operations spend the machine's
 * cores on (the service, Postgres, Redis, the load generator). Linux only; elsewhere the snapshots are
 * empty and the split reads "n/a".
 */
export type CpuSnapshot = Map<string, { group: string; us: number }>;

const TICK_US = 1e6 / 100; // USER_HZ is 100 on every Linux architecture the bench runs on

/** Microseconds of CPU (user + system) used so far by each process of a group; `groupOf` names a process's group. */
export function cpuSnapshot(groupOf: (pid: number, comm: string) => string | undefined): CpuSnapshot {
  const totals: CpuSnapshot = new Map();
  let pids: string[];
  try {
    pids = readdirSync('/proc').filter((p) => /^\d+$/.test(p));
  } catch {
    return totals;
  }
  for (const pid of pids) {
    let stat: string;
    try {
      stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    } catch {
      continue; // exited meanwhile
    }
    // "pid (comm) state ..." — comm may hold spaces or parentheses, so split after the last ')'.
    const close = stat.lastIndexOf(')');
    const comm = stat.slice(stat.indexOf('(') + 1, close);
    const group = groupOf(Number(pid), comm);
    if (!group) continue;
    const fields = stat.slice(close + 2).split(' ');
    // utime + stime (fields 14 and 15 of stat); for this process also cutime + cstime (16, 17): the
    // children it has waited for, such as a wrk run that has exited by the time of the second snapshot.
    let ticks = Number(fields[11]) + Number(fields[12]);
    if (Number(pid) === process.pid) ticks += Number(fields[13]) + Number(fields[14]);
    // A process is its pid and its start time (field 22): a pid reused between two snapshots is another process.
    totals.set(`${pid}@${fields[19]}`, { group, us: ticks * TICK_US });
  }
  return totals;
}

/**
 * CPU microseconds per operation by group between two snapshots, process by process: one that started
 * in between counts from zero; one that exited in between (an autovacuum worker, say) is left out, as
 * its time since the first snapshot can no longer be read.
 */
export function cpuPerOp(before: CpuSnapshot, after: CpuSnapshot, ops: number, order: string[]): Record<string, number> {
  const out: Record<string, number> = Object.fromEntries(order.map((group) => [group, 0]));
  if (ops === 0) return out;
  for (const [key, { group, us }] of after) {
    if (!(group in out)) continue;
    const earlier = before.get(key);
    out[group] += (us - (earlier?.group === group ? earlier.us : 0)) / ops;
  }
  return out;
}

/** E.g. "server 284 · postgres 223 · redis 183 · load 50 (total 740)". */
export function formatCpu(perOp: Record<string, number>): string {
  const entries = Object.entries(perOp);
  if (entries.every(([, us]) => us === 0)) return 'n/a';
  const total = entries.reduce((sum, [, us]) => sum + us, 0);
  return `${entries.map(([group, us]) => `${group} ${us.toFixed(0)}`).join(' · ')} (total ${total.toFixed(0)})`;
}
