import { DynamicModule, Global, Module } from '@nestjs/common';
import { APP_FILTER } from '@nestjs/core';
import { TerminusModule } from '@nestjs/terminus';
import { TypeOrmModule } from '@nestjs/typeorm';
import { AllExceptionsFilter } from './common/all-exceptions.filter.js';
import { AppConfig } from './config/app-config.js';
import { CommitRepository } from './database/commit.repository.js';
import { dataSourceOptions } from './database/data-source.js';
import { GenerationRepository } from './database/generation.repository.js';
import { JobMutexRepository } from './database/job-mutex.repository.js';
import { PoolRepository } from './database/pool.repository.js';
import { ResourceRepository } from './database/resource.repository.js';
import { HealthController } from './health/health.controller.js';
import { MetricsController } from './metrics/metrics.controller.js';
import { MetricsService } from './metrics/metrics.service.js';
import { PoolCatalog } from './pools/pool-catalog.service.js';
import { PoolsController } from './pools/pools.controller.js';
import { PoolsService } from './pools/pools.service.js';
import { HoldStore } from './redis/hold-store.repository.js';
import { REDIS, createRedis } from './redis/redis.client.js';
import { WakeUps } from './redis/wake-ups.js';
import { CommitService } from './reservations/commit.service.js';
import { ReservationsController } from './reservations/reservations.controller.js';
import { ReservationsService } from './reservations/reservations.service.js';
import { RebuildService } from './sweeper/rebuild.service.js';
import { SweeperService } from './sweeper/sweeper.service.js';
import { TasksController } from './tasks/tasks.controller.js';
import { TasksService } from './tasks/tasks.service.js';

@Global()
@Module({})
class InfrastructureModule {
  static forRoot(config: AppConfig): DynamicModule {
    const shared = [
      HoldStore,
      PoolRepository,
      ResourceRepository,
      CommitRepository,
      JobMutexRepository,
      GenerationRepository,
      MetricsService,
      PoolCatalog,
      WakeUps,
    ];
    return {
      module: InfrastructureModule,
      providers: [
        { provide: AppConfig, useValue: config },
        // The connection is opened (and Redis' eviction policy checked) by createApp before Nest starts.
        { provide: REDIS, useFactory: () => createRedis(config) },
        ...shared,
      ],
      exports: [AppConfig, REDIS, ...shared],
    };
  }
}

@Module({})
export class AppModule {
  static forRoot(config: AppConfig): DynamicModule {
    return {
      module: AppModule,
      imports: [
        InfrastructureModule.forRoot(config),
        TypeOrmModule.forRoot({ ...dataSourceOptions(config), retryAttempts: 0 }),
        TerminusModule.forRoot({ logger: false }),
      ],
      controllers: [PoolsController, ReservationsController, TasksController, HealthController, MetricsController],
      providers: [
        { provide: APP_FILTER, useClass: AllExceptionsFilter },
        PoolsService,
        ReservationsService,
        CommitService,
        TasksService,
        RebuildService,
        SweeperService,
      ],
    };
  }
}
