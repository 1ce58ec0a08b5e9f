import { ChildProcess, execFileSync, spawn } from 'node:child_process';
import { chownSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { freePort, serviceArgs } from '../support/services.js';

const PG_BIN = '/usr/lib/postgresql/15/bin';
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** Runs a Postgres command as the postgres user when we are root (initdb refuses root). */
function asPostgres(cmd: string, args: string[]): string[] {
  return process.getuid?.() === 0 ? ['runuser', '-u', 'postgres', '--', cmd, ...args] : [cmd, ...args];
}

function run(argv: string[]): string {
  return execFileSync(argv[0], argv.slice(1), { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });
}

/** A Postgres cluster of the suite's own (initdb + pg_ctl), on a spare port, that it may shut down hard. */
export class ChaosPostgres {
  private constructor(
    readonly dir: string,
    readonly port: number,
  ) {}

  static async create(): Promise<ChaosPostgres> {
    const dir = mkdtempSync(join(tmpdir(), 'respool-chaos-pg-'));
    if (process.getuid?.() === 0)
      chownSync(dir, Number(run(['id', '-u', 'postgres']).trim()), Number(run(['id', '-g', 'postgres']).trim()));
    run(asPostgres(`${PG_BIN}/initdb`, ['-D', `${dir}/data`, '-U', 'postgres', '--auth=trust', '-E', 'UTF8', '--no-sync']));
    const pg = new ChaosPostgres(dir, await freePort());
    await pg.start();
    return pg;
  }

  get url(): string {
    return `postgres://postgres@127.0.0.1:${this.port}/respool`;
  }

  async start(): Promise<void> {
    const options = [
      `-p ${this.port}`,
      '-c listen_addresses=127.0.0.1',
      `-c unix_socket_directories=${this.dir}`,
      '-c max_connections=300',
      '-c fsync=off', // the machine does not crash in this suite; commits still reach the OS before they are acknowledged
      '-c shared_buffers=128MB',
    ].join(' ');
    run(asPostgres(`${PG_BIN}/pg_ctl`, ['-D', `${this.dir}/data`, '-l', `${this.dir}/log`, '-w', '-t', '60', '-o', options, 'start']));
  }

  /** `pg_ctl stop -m immediate`: every backend dies at once, like a crash; recovery runs on the next start. */
  stopImmediate(): void {
    run(asPostgres(`${PG_BIN}/pg_ctl`, ['-D', `${this.dir}/data`, '-m', 'immediate', '-w', 'stop']));
  }

  destroy(): void {
    try {
      run(asPostgres(`${PG_BIN}/pg_ctl`, ['-D', `${this.dir}/data`, '-m', 'fast', '-w', 'stop']));
    } catch {
      /* already down */
    }
    rmSync(this.dir, { recursive: true, force: true });
  }
}

/** One respool instance as a separate process (the built service, started as `npm run start:prod` does). */
export class Instance {
  private child: ChildProcess | undefined;
  state: 'up' | 'paused' | 'down' = 'down';

  constructor(
    readonly name: string,
    readonly port: number,
    private readonly env: Record<string, string>,
    private readonly logFile: string,
  ) {}

  get url(): string {
    return `http://127.0.0.1:${this.port}`;
  }

  async start(): Promise<void> {
    const { openSync } = await import('node:fs');
    const out = openSync(this.logFile, 'a');
    this.child = spawn(process.execPath, serviceArgs(), {
      env: { ...process.env, ...this.env, PORT: String(this.port), HOST: '127.0.0.1' },
      stdio: ['ignore', out, out],
    });
    const started = Date.now();
    while (Date.now() - started < 60_000) {
      if (this.child.exitCode !== null) throw new Error(`${this.name} exited with ${this.child.exitCode}; see ${this.logFile}`);
      try {
        const res = await fetch(`${this.url}/health/live`, { signal: AbortSignal.timeout(1000) });
        if (res.ok) {
          // A process that could not listen exits at once: then the answer came from another one on the port.
          await sleep(300);
          if (this.child.exitCode !== null) throw new Error(`${this.name} exited with ${this.child.exitCode}; see ${this.logFile}`);
          this.state = 'up';
          return;
        }
      } catch {
        /* not listening yet */
      }
      await sleep(100);
    }
    throw new Error(`${this.name} did not become live; see ${this.logFile}`);
  }

  kill9(): void {
    this.child?.kill('SIGKILL');
    this.state = 'down';
  }

  get pid(): number | undefined {
    return this.child?.pid;
  }

  pause(): void {
    this.child?.kill('SIGSTOP');
    this.state = 'paused';
  }

  resume(): void {
    this.child?.kill('SIGCONT');
    this.state = 'up';
  }

  /** SIGTERM; resolves with the exit code and how long the graceful shutdown took. */
  async terminate(): Promise<{ code: number | null; ms: number }> {
    const child = this.child!;
    const started = Date.now();
    const exited = new Promise<number | null>((resolve) => child.once('exit', (code) => resolve(code)));
    child.kill('SIGTERM');
    const code = await exited;
    this.state = 'down';
    return { code, ms: Date.now() - started };
  }

  async stop(): Promise<void> {
    const child = this.child;
    if (!child || child.exitCode !== null || child.signalCode !== null) return;
    if (this.state === 'paused') child.kill('SIGCONT');
    await new Promise<void>((resolve) => {
      const t = setTimeout(() => child.kill('SIGKILL'), 15_000);
      child.once('exit', () => {
        clearTimeout(t);
        resolve();
      });
      child.kill('SIGTERM');
    });
    this.state = 'down';
  }
}
