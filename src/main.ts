import { format } from 'node:util';
import type { NestFastifyApplication } from '@nestjs/platform-fastify';
import { createPino } from './common/logger.js';
// The rest is imported once the signal handlers are in (main): loading Nest and the drivers takes about a second.
import type * as Config from './config/app-config.js';
import type * as Factory from './app.factory.js';
import type * as Dependencies from './common/dependency-errors.js';

let modules: { config: typeof Config; dependencies: typeof Dependencies } | undefined;

/**
 * The process's own lines (start-up, signals, shutdown), JSON like the app's: at info whatever LOG_LEVEL says, which is
 * read with the rest of the configuration and may be what is wrong with it.
 */
const log = createPino('info').child({ context: 'respool' });

/**
 * What a library writes to the console goes through pino too, one JSON line each (ioredis warns with console.warn that
 * Redis takes no password, say): the logs stay lines an operator's tools can parse.
 */
function consoleThroughPino(): void {
  const as =
    (level: 'info' | 'warn' | 'error') =>
    (...args: unknown[]) =>
      log[level]({ context: 'console' }, format(...args));
  console.log = as('info');
  console.info = as('info');
  console.warn = as('warn');
  console.error = as('error');
}

/** What is wrong, in one line: the message, or (for a configuration) each problem, with the problems listed apart too. */
function cannotStart(err: unknown): void {
  if (modules !== undefined && err instanceof modules.config.ConfigError) {
    log.fatal({ problems: err.problems }, `cannot start: invalid configuration: ${err.problems.join('; ')}`);
  } else if (modules !== undefined && err instanceof modules.dependencies.StartupError) {
    log.fatal(`cannot start: ${err.message}`);
  } else {
    // Not foreseen: its stack, for the bug report (not the whole object, which for a driver error is every field).
    log.fatal(
      { stack: err instanceof Error ? err.stack : String(err) },
      `cannot start: ${err instanceof Error ? err.message : String(err)}`,
    );
  }
}

async function main(): Promise<void> {
  consoleThroughPino();
  // Set once it listens; until then a signal stops the process at once.
  const running: { app?: NestFastifyApplication; close?: typeof Factory.closeGracefully } = {};
  let stopping = false;
  let shutdownTimeoutMs = 10_000;
  // Installed first: a signal during start-up (connecting, migrating) stops the process with a line saying so, and
  // so does a second signal during the graceful shutdown (it cuts what is in flight).
  for (const signal of ['SIGTERM', 'SIGINT'] as const) {
    process.on(signal, () => {
      const { app, close } = running;
      if (app === undefined || close === undefined) {
        log.info(`${signal} during start-up: exiting`);
        process.exit(0);
      }
      if (stopping) {
        log.warn(`${signal} again during the shutdown: exiting now, cutting what is in flight`);
        process.exit(1);
      }
      stopping = true;
      log.info(`${signal}: shutting down (answering what is in flight, at most SHUTDOWN_TIMEOUT_MS ${shutdownTimeoutMs} ms)`);
      setTimeout(() => {
        log.error(`shutdown took longer than ${shutdownTimeoutMs} ms; exiting`);
        process.exit(1);
      }, shutdownTimeoutMs).unref();
      close(app).then(
        () => {
          log.info('stopped');
          process.exit(0);
        },
        (err: unknown) => {
          log.error({ stack: err instanceof Error ? err.stack : String(err) }, 'error during shutdown');
          process.exit(1);
        },
      );
    });
  }
  await import('reflect-metadata');
  const [configModule, factory, dependencies]: [typeof Config, typeof Factory, typeof Dependencies] = await Promise.all([
    import('./config/app-config.js'),
    import('./app.factory.js'),
    import('./common/dependency-errors.js'),
  ]);
  modules = { config: configModule, dependencies };
  const { closeGracefully, createApp } = factory;
  const config = configModule.loadConfig(process.env);
  shutdownTimeoutMs = config.SHUTDOWN_TIMEOUT_MS;
  const created = await createApp(config);
  try {
    await created.listen({ port: config.PORT, host: config.HOST });
  } catch (err) {
    await created.close().catch(() => undefined);
    // The port taken, a HOST that does not resolve or is not this machine's: one line, not a stack.
    throw new dependencies.StartupError(`cannot listen on ${config.HOST}:${config.PORT}: ${(err as Error).message}`);
  }
  running.app = created;
  running.close = closeGracefully;
  // The port listened on (PORT 0: one the system chose).
  const address = created.getHttpServer().address();
  const port = typeof address === 'object' && address !== null ? address.port : config.PORT;
  log.info(`listening on http://${config.HOST}:${port} (docs at /docs)`);
}

main().catch((err: unknown) => {
  cannotStart(err);
  process.exit(1);
});
